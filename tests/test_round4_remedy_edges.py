"""Issue 42, items 4-7, on the edge that broke each, against an independent computation:
churn's held-out rows (exact integer spacing), churn's KL with actions masked by -inf
logits, continual backprop ranking a float64 model's utilities that differ by 1e-9 (and
zeroing the replaced unit's bias, as the paper's GnT), and a probe on a component with a
plasticity injection reading the injected output when its hooks were installed first."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import JSONL_ONLY, REMEDY_SEED, ReluNet, remedy_seeds, remedy_session
from torch import nn

from policy_probes import ProbeSession, ProbeSettings
from policy_probes.probes.churn import attach_churn_hooks
from policy_probes.probes.preactivation import attach_preactivation_hooks
from policy_probes.remedies import continual_backprop, plasticity_injection


def session_for(model: nn.Module, tmp_path, optimizer=None) -> ProbeSession:
    probing = ProbeSettings(sinks=JSONL_ONLY, probe_budget=None)
    return ProbeSession(model, run=tmp_path, probing=probing, optimizer=optimizer)


# ---------------------------------------------------------------- item 4: held-out rows
def documented_rows(rows: int, size: int) -> list[int]:
    """docs/probes/churn.md: floor(i (R-1) / (B-1)) in Python's integers; all rows when
    R <= B, row 0 when B = 1."""
    if rows <= size:
        return list(range(rows))
    if size == 1:
        return [0]
    return [i * (rows - 1) // (size - 1) for i in range(size)]


def test_churn_holds_out_the_documented_rows_for_every_rollout_up_to_120_rows() -> None:
    for size in range(1, 126):  # beyond 120: batches larger than the rollout too
        tracker = attach_churn_hooks(batch_size=size)
        for rows in range(1, 121):
            obs = torch.arange(rows).unsqueeze(1)
            got = tracker.held_out(obs)[:, 0].tolist()
            assert got == documented_rows(rows, size), (rows, size)
    # (R, B) = (43, 39), one of the 85 pairs the rounded-down float linspace got wrong
    assert documented_rows(43, 39)[19] == 21
    assert attach_churn_hooks(batch_size=39).held_out(torch.arange(43))[19] == 21


class ValueNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)


def test_a_session_measures_churn_on_the_documented_rows_of_the_last_rollout(tmp_path) -> None:
    """R = 43, B = 39: rollout rows 21 (documented) and 20 (the old linspace) differ."""
    torch.manual_seed(0)
    model = ValueNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    session = session_for(model, tmp_path, opt)
    session.add_training_hook("critic", attach_churn_hooks(kind="value", batch_size=39))
    g = torch.Generator().manual_seed(1)
    rollouts = [torch.randn(43, 3, generator=g) * 3 for _ in range(2)]
    with session:
        for epoch, obs in enumerate(rollouts):
            before = copy.deepcopy(model)
            session.set_phase("rollout")
            session.rollout_end(observations=obs)
            session.set_phase("train")
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(16, 3, generator=g)).square().mean().backward()
                opt.step()
            got = session.epoch_end(step=epoch + 1)["probes/churn/critic/value_change"]
    # epoch 2 measured on epoch 1's rollout: |V_after - V_before| on its documented rows
    with torch.no_grad():
        change = (model(rollouts[0]) - before(rollouts[0])).abs().squeeze(1).double()
    rows = documented_rows(43, 39)
    old = torch.linspace(0, 42, 39, dtype=torch.float64).long().tolist()
    assert rows != old
    assert got == pytest.approx(change[rows].mean().item(), rel=1e-6)
    assert change[old].mean().item() != pytest.approx(got, rel=1e-6)  # the rows matter


# ---------------------------------------------------------------- item 5: masked actions
class MaskedActor(nn.Module):
    """Logits of 4 actions; action 1 is invalid where obs[:, 0] > 0, action 3 where the
    ``banned`` buffer says so (a mask that changes between two forwards)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.register_buffer("banned", torch.zeros(4, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        invalid = torch.zeros(x.shape[0], 4, dtype=torch.bool)
        invalid[:, 1] = x[:, 0] > 0
        return self.linear(x).masked_fill(invalid | self.banned, float("-inf"))


class MaskedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = MaskedActor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.actor(x)


def kl_over_finite(before: np.ndarray, after: np.ndarray) -> list[float]:
    """Per row, the KL of the two softmaxes over the actions finite in both (numpy)."""
    out = []
    for b, a in zip(before, after, strict=True):
        keep = np.isfinite(b) & np.isfinite(a)
        lp = b[keep] - np.log(np.exp(b[keep]).sum())
        lq = a[keep] - np.log(np.exp(a[keep]).sum())
        out.append(float((np.exp(lp) * (lp - lq)).sum()))
    return out


def churn_epoch(
    tmp_path, policy: MaskedPolicy, obs: torch.Tensor, ban_after: bool
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One epoch: the churn probe's record, and the logits before and after by hand."""
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    session = session_for(policy, tmp_path, opt)
    session.add_training_hook("actor", attach_churn_hooks(kind="categorical", batch_size=8))
    with torch.no_grad():
        before = policy(obs)
    with session:
        session.set_phase("rollout")
        session.rollout_end(observations=obs)
        session.set_phase("train")
        for _ in range(4):
            opt.zero_grad()
            (-policy(obs).log_softmax(1)[:, 0].mean()).backward()  # action 0 is never masked
            opt.step()
        if ban_after:
            policy.actor.banned[3] = True
        metrics = session.epoch_end(step=1)
    with torch.no_grad():
        after = policy(obs)
    return metrics, before, after


def test_churn_kl_with_masked_actions_is_the_kl_over_the_valid_ones(tmp_path) -> None:
    torch.manual_seed(2)
    policy = MaskedPolicy()
    obs = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    assert 0 < int((obs[:, 0] > 0).sum()) < 8  # some states mask action 1, some do not
    metrics, before, after = churn_epoch(tmp_path / "a", policy, obs, ban_after=False)
    kl = kl_over_finite(before.double().numpy(), after.double().numpy())
    assert all(math.isfinite(v) for v in kl) and max(kl) > 1e-3
    assert metrics["probes/churn/actor/policy_kl"] == pytest.approx(np.mean(kl), rel=1e-6)
    assert metrics["probes/churn/actor/policy_kl_max"] == pytest.approx(max(kl), rel=1e-6)
    # |delta logit| over the 4 entries, an entry masked both times unchanged
    b, a = before.double().numpy(), after.double().numpy()
    finite = np.isfinite(b)
    assert (finite == np.isfinite(a)).all()
    dl = [np.abs(ra[f] - rb[f]).sum() / 4 for ra, rb, f in zip(a, b, finite, strict=True)]
    assert metrics["probes/churn/actor/output_change"] == pytest.approx(np.mean(dl), rel=1e-6)


def test_churn_kl_is_infinite_when_an_action_with_mass_gets_masked(tmp_path) -> None:
    """p_a > 0 and q_a = 0: KL(p || q) is +inf (docs/probes/churn.md), not NaN."""
    torch.manual_seed(2)
    obs = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    metrics, *_ = churn_epoch(tmp_path, MaskedPolicy(), obs, ban_after=True)
    assert metrics["probes/churn/actor/policy_kl"] == math.inf
    assert metrics["probes/churn/actor/policy_kl_max"] == math.inf


# ---------------------------------------------------------------- item 6: CBP in float64
class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_continual_backprop_ranks_a_float64_models_utilities_in_float64(tmp_path) -> None:
    """Units 0 and 1 have contribution utilities 1 + 1e-9 and 1 (float32 ties them, and
    the tie went to unit 0); unit 1, the lower, is replaced, its bias set to 0."""
    torch.manual_seed(0)
    model = TwoLayer().double()
    with torch.no_grad():
        model.body[0].weight.copy_(torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5]]))
        model.body[0].bias.copy_(torch.tensor([1.0, 1.0, 1.0]))
        model.head.weight.copy_(torch.tensor([[1.0 + 1e-9, 1.0, 3.0]], dtype=torch.float64))
    x = torch.ones(4, 2, dtype=torch.float64)
    # the utility by hand: mean|h_i| * sum_k |w_ik| (the step below leaves the weights: lr 0)
    h = torch.relu(x @ model.body[0].weight.detach().T + model.body[0].bias.detach())
    utility = h.abs().mean(0) * model.head.weight.detach().abs().sum(0)
    assert utility[0] - utility[1] == pytest.approx(1e-9, rel=1e-6)
    assert utility[:2].float()[0] == utility[:2].float()[1]  # equal in float32
    lowest = int(torch.argmin(utility))
    assert lowest == 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    session = remedy_session(tmp_path, model, opt)
    # maturity 0 and decay 0.5: after one step every unit is eligible, the bias-corrected
    # utility is the contribution itself, and 0.34 * 3 units replace one
    session.add_remedy(
        "body",
        continual_backprop(
            replacement_rate=0.34,
            maturity_threshold=0,
            decay=0.5,
            consumer="head",
            seed=REMEDY_SEED,
        ),
    )
    with session:
        session.set_phase("train")
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        metrics = session.epoch_end(step=1)
    assert metrics["remedies/continual_backprop/body/units_reset"] == 1.0
    (seed,) = remedy_seeds(REMEDY_SEED, "continual_backprop", "body", 1)
    torch.manual_seed(seed)
    fresh = nn.Linear(2, 3, dtype=torch.float64)  # its initialiser, seeded as the remedy
    weight, bias = model.body[0].weight.detach(), model.body[0].bias.detach()
    assert torch.equal(weight[lowest], fresh.weight.detach()[lowest])
    assert bias[lowest] == 0.0  # GnT: a new unit starts with a zero bias
    assert model.head.weight.detach()[0, lowest] == 0.0
    for unit in (0, 2):  # the others are untouched
        assert torch.equal(weight[unit], before["body.0.weight"][unit])
        assert bias[unit] == before["body.0.bias"][unit]
        assert model.head.weight[0, unit] == before["head.weight"][0, unit]


# ---------------------------------------------------------------- item 7: injection
@pytest.mark.parametrize("phases", ["always_train", "inferred", "switched"])
def test_a_probe_on_an_injected_component_reads_the_injected_output(tmp_path, phases) -> None:
    """Every pass observed (``probe_budget=None``): the probe's hooks are installed once,
    before the injection's; ``switched`` re-arms them after it (rollout -> train)."""
    torch.manual_seed(3)
    model = ReluNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    session = remedy_session(tmp_path, model, opt)
    session.add_training_hook("body", attach_preactivation_hooks())
    session.add_remedy("body", plasticity_injection(every_epochs=1, seed=REMEDY_SEED))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 5, generator=g, dtype=torch.float64) for _ in range(5)]

    def train(batch: list[torch.Tensor]) -> None:
        for x in batch:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    with session:
        if phases != "inferred":  # inferred: forwards with gradients are training ones
            session.set_phase("train")
        train(xs[:1])
        assert session.epoch_end(step=1)["remedies/plasticity_injection/body/fired"] == 1.0
        inj = session.remedies.bound[0].prepared
        train(xs[1:4])  # theta' moves away from theta'_0
        session.epoch_end(step=2)
        if phases == "switched":
            session.set_phase("rollout")
            with torch.no_grad():
                model(xs[0])
            session.set_phase("train")
        model(xs[4])  # the one forward of epoch 3
        got = session.epoch_end(step=3)["probes/preactivation/body/feature_norm"]
    with torch.no_grad():  # h_theta + h_theta' - h_theta'_0, by hand, layer by layer
        frozen_out = xs[4]
        for layer in model.body:
            frozen_out = layer.forward(frozen_out)
        injected = frozen_out + inj.trainable.forward(xs[4]) - inj.frozen.forward(xs[4])
    want = injected.norm(dim=1).mean().item()
    assert abs(want - frozen_out.norm(dim=1).mean().item()) > 1e-3  # the two differ
    assert got == pytest.approx(want, rel=1e-9)
