"""The remedies that act at every optimizer step (l2_init, soft_shrink_perturb,
continual_backprop) and plasticity injection, each against its formula computed by hand
(issue 25): L2 Init's gradient term in an Adam step, soft shrink-and-perturb's
``s * theta + n * theta_init`` per step, CBP's utilities, maturity and replaced units,
and an injection that keeps the outputs bit for bit and trains only the new copy."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import REMEDY_SEED, ReluNet, remedy_seeds, remedy_session
from torch import nn

from policy_probes.plugins import from_spec
from policy_probes.remedies import (
    continual_backprop,
    l2_init,
    plasticity_injection,
    soft_shrink_perturb,
)


def batches(
    n: int, seed: int = 0, device: torch.device = torch.device("cpu")
) -> list[torch.Tensor]:
    """``n`` batches drawn on the CPU from a generator seeded with ``seed``, moved to
    ``device``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 5, generator=g).to(device) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def fresh_linear(i: int, o: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(i, o)


# ---------------------------------------------------------------- l2_init
def test_l2_init_step_is_adam_on_the_regularised_gradient(tmp_path, device: torch.device):
    torch.manual_seed(0)
    model = ReluNet().to(device)
    ref = copy.deepcopy(model)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr, coef, (b1, b2), eps = 1e-2, 0.3, (0.9, 0.999), 1e-8
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(b1, b2), eps=eps)
    session = remedy_session(tmp_path, model, opt)
    session.add_remedy("body", l2_init(coef=coef))
    m = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    v = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    with session:
        session.set_phase("train")
        for t, x in enumerate(batches(4, device=device), start=1):
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
            # by hand: the gradient of loss + coef/2 ||theta - theta_0||^2 on body only
            ref.zero_grad()
            loss_of(ref, x).backward()
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    g = p.grad + (coef * (p - init[n]) if n.startswith("body.") else 0)
                    m[n] = b1 * m[n] + (1 - b1) * g
                    v[n] = b2 * v[n] + (1 - b2) * g * g
                    m_hat, v_hat = m[n] / (1 - b1**t), v[n] / (1 - b2**t)
                    p -= lr * m_hat / (v_hat.sqrt() + eps)
            for n, p in model.named_parameters():
                assert torch.allclose(p, dict(ref.named_parameters())[n], rtol=1e-5, atol=1e-6), n
            assert any(not torch.equal(p, init[n]) for n, p in model.named_parameters())
        metrics = session.epoch_end(step=1)
    distance = math.sqrt(
        sum(((p - init[n]) ** 2).sum().item() for n, p in model.named_parameters() if "body" in n)
    )
    assert metrics["remedies/l2_init/body/steps"] == 4.0
    assert metrics["remedies/l2_init/body/distance"] == pytest.approx(distance, rel=1e-6)
    # the loss the loop computes is unchanged: only the gradients carry the term
    assert not any(k.startswith("loss") for k in metrics if "l2_init" in k)


# ---------------------------------------------------------------- soft shrink-and-perturb
def test_soft_shrink_perturb_applies_the_formula_after_every_step(tmp_path, device: torch.device):
    torch.manual_seed(1)
    model = ReluNet().to(device)
    ref = copy.deepcopy(model)
    lr, s, n = 0.05, 0.97, 0.02
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    session = remedy_session(tmp_path, model, opt)
    session.add_remedy("body", soft_shrink_perturb(shrink=s, noise=n, seed=REMEDY_SEED))
    steps = 3
    seeds = remedy_seeds(REMEDY_SEED, "soft_shrink_perturb", "body", 2 * steps)  # 2 layers a step
    with session:
        session.set_phase("train")
        for k, x in enumerate(batches(steps, seed=3, device=device)):
            rng = torch.get_rng_state()
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
            assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
            ref.zero_grad()
            loss_of(ref, x).backward()
            # the remedy draws its fresh values on the CPU (its own CPU generator, then moved)
            fresh = {
                "body.0": fresh_linear(5, 16, seeds[2 * k]).to(device),
                "body.2": fresh_linear(16, 12, seeds[2 * k + 1]).to(device),
            }
            with torch.no_grad():
                for name, p in ref.named_parameters():
                    p -= lr * p.grad
                    layer, _, kind = name.rpartition(".")
                    if layer in fresh:
                        p.copy_(s * p + n * getattr(fresh[layer], kind).detach())
            for name, p in model.named_parameters():
                expected = dict(ref.named_parameters())[name]
                assert torch.allclose(p, expected, rtol=1e-6, atol=1e-7), (k, name)
        assert session.epoch_end(step=1)["remedies/soft_shrink_perturb/body/steps"] == steps


# ---------------------------------------------------------------- continual backprop
class Reference:
    """CBP computed by hand, unit by unit, on ReluNet (body.0 -> body.2 -> head)."""

    def __init__(
        self, rate: float, maturity: int, decay: float, device: torch.device = torch.device("cpu")
    ) -> None:
        self.rate, self.m, self.eta = rate, maturity, decay
        # on the device of the parameters and features it is given
        self.util = [
            torch.zeros(16, dtype=torch.float64, device=device),
            torch.zeros(12, dtype=torch.float64, device=device),
        ]
        self.ages = [[0] * 16, [0] * 12]
        self.pending = [0.0, 0.0]

    def features(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        h0 = torch.relu(x @ params["body.0.weight"].T + params["body.0.bias"])
        h1 = torch.relu(h0 @ params["body.2.weight"].T + params["body.2.bias"])
        return [h0.double(), h1.double()]

    def step(self, feats: list[torch.Tensor], after: dict[str, torch.Tensor]) -> list[list[int]]:
        """Replaced units per layer, by hand: utilities from the step's features and the
        outgoing weights after the optimizer step."""
        out_w = [after["body.2.weight"], after["head.weight"]]
        chosen: list[list[int]] = []
        for i in range(2):
            mag = out_w[i].double().abs().sum(0)
            contribution = feats[i].abs().mean(0) * mag
            self.util[i] = self.eta * self.util[i] + (1 - self.eta) * contribution
            self.ages[i] = [a + 1 for a in self.ages[i]]
            eligible = [u for u, a in enumerate(self.ages[i]) if a > self.m]
            self.pending[i] += self.rate * len(eligible)
            n = int(self.pending[i])
            self.pending[i] -= n
            corrected = {
                u: self.util[i][u].item() / (1 - self.eta ** self.ages[i][u]) for u in eligible
            }
            units = sorted(eligible, key=lambda u: (corrected[u], u))[:n]
            for u in units:
                self.util[i][u] = 0.0
                self.ages[i][u] = 0
            chosen.append(units)
        return chosen


def test_continual_backprop_replaces_the_units_a_hand_computation_selects(
    tmp_path, device: torch.device
):
    torch.manual_seed(2)
    model = ReluNet()
    with torch.no_grad():
        model.body[0].bias[:3] = -20.0  # three dead units: zero utility, replaced first
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    snap: dict[str, object] = {}

    def before_remedy(*_):  # registered first: runs after the step, before CBP
        snap["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        snap["moments"] = {
            n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
        }

    opt.register_step_post_hook(before_remedy)
    rate, maturity, decay = 0.3, 2, 0.9
    session = remedy_session(tmp_path, model, opt)
    session.add_remedy(
        "body",
        continual_backprop(
            replacement_rate=rate,
            maturity_threshold=maturity,
            decay=decay,
            consumer="head",
            seed=REMEDY_SEED,
        ),
    )
    ref = Reference(rate, maturity, decay, device)
    seeds = iter(remedy_seeds(REMEDY_SEED, "continual_backprop", "body", 64))
    layers = [("body.0", "body.2"), ("body.2", "head")]
    total = [0, 0]
    xs = batches(8, seed=4, device=device)
    probe = torch.randn(32, 5, generator=torch.Generator().manual_seed(9)).to(device)
    with session:
        session.set_phase("train")
        for x in xs:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
            chosen = ref.step(ref.features(before, x), snap["params"])
            params, moments = snap["params"], snap["moments"]
            expected = {n: t.clone() for n, t in params.items()}
            zeroed = {n: t.clone() for n, t in params.items()}
            touched: dict[str, list[tuple[int, int]]] = {n: [] for n in params}
            for (producer, consumer), units in zip(layers, chosen, strict=True):
                if not units:
                    continue
                idx = torch.tensor(units).to(device)
                shape = params[f"{producer}.weight"].shape
                f = fresh_linear(*reversed(shape), next(seeds)).to(device)
                expected[f"{producer}.weight"][idx] = f.weight.detach()[idx]
                expected[f"{producer}.bias"][idx] = 0.0  # GnT zeroes a replaced unit's bias
                expected[f"{consumer}.weight"][:, idx] = 0.0
                zeroed[f"{consumer}.weight"][:, idx] = 0.0
                touched[f"{producer}.weight"].append((0, units))
                touched[f"{producer}.bias"].append((0, units))
                touched[f"{consumer}.weight"].append((1, units))
            for i, units in enumerate(chosen):
                total[i] += len(units)
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), expected[n]), n
                for key in ("exp_avg", "exp_avg_sq"):
                    want = moments[n][key].clone()
                    for dim, units in touched[n]:
                        want.index_fill_(dim, torch.tensor(units).to(device), 0.0)
                    assert torch.equal(opt.state[p][key], want), (n, key)
                assert torch.equal(opt.state[p]["step"], moments[n]["step"])  # step kept
            # outputs: the pre-replacement model with those outgoing weights zeroed
            reference = copy.deepcopy(model)
            reference.load_state_dict(zeroed)
            with torch.no_grad():
                assert torch.equal(model(probe), reference(probe))
        metrics = session.epoch_end(step=1)
    assert total[0] > 3 and total[1] > 0  # both layers replaced units, the dead ones too
    assert metrics["remedies/continual_backprop/body/units_reset"] == sum(total)
    cbp_layers = [k for k in metrics if k.endswith("/units_reset") and "continual" in k]
    assert len(cbp_layers) == 3  # the component's total and one per unit layer


def test_continual_backprop_refuses_a_layer_norm_between_units_and_consumer(tmp_path):
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    session = remedy_session(tmp_path, model, opt)
    with pytest.raises(ValueError, match="continual_backprop on '0'"):
        session.add_remedy("0", continual_backprop(consumer="3"))


# ---------------------------------------------------------------- plasticity injection
def test_plasticity_injection_keeps_outputs_and_trains_only_the_new_copy(
    tmp_path, device: torch.device
):
    torch.manual_seed(3)
    model = ReluNet().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    session = remedy_session(tmp_path, model, opt)
    session.add_remedy("body", plasticity_injection(every_epochs=1, seed=REMEDY_SEED))
    probe = torch.randn(32, 5, generator=torch.Generator().manual_seed(1)).to(device)
    xs = batches(3, seed=5, device=device)
    with session:
        session.set_phase("train")
        for x in xs[:1]:
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
        with torch.no_grad():
            out_before = model(probe)
        metrics = session.epoch_end(step=1)
        assert metrics["remedies/plasticity_injection/body/fired"] == 1.0
        with torch.no_grad():
            assert torch.equal(model(probe), out_before)  # bit-identical at injection
        inj = session.remedies.bound[0].prepared
        s0, s1 = remedy_seeds(REMEDY_SEED, "plasticity_injection", "body", 2)
        fresh = {"0": fresh_linear(5, 16, s0).to(device), "2": fresh_linear(16, 12, s1).to(device)}
        for layer, f in fresh.items():  # theta' is the layers' own fresh initialisation
            assert torch.equal(inj.trainable[int(layer)].weight, f.weight.detach())
            assert torch.equal(inj.frozen[int(layer)].bias, f.bias.detach())
        body0 = {n: p.detach().clone() for n, p in model.body.named_parameters()}
        head0 = {n: p.detach().clone() for n, p in model.head.named_parameters()}
        frozen0 = {n: p.detach().clone() for n, p in inj.frozen.named_parameters()}
        new0 = {n: p.detach().clone() for n, p in inj.trainable.named_parameters()}
        for x in xs[1:]:
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
        for n, p in model.body.named_parameters():
            assert torch.equal(p, body0[n]) and not p.requires_grad  # theta is frozen
        for n, p in inj.frozen.named_parameters():
            assert torch.equal(p, frozen0[n])  # theta'_0 too
        assert all(not torch.equal(p, new0[n]) for n, p in inj.trainable.named_parameters())
        assert any(not torch.equal(p, head0[n]) for n, p in model.head.named_parameters())
        with torch.no_grad():  # h_theta + h_theta' - h_theta'_0 by hand (forward(): no hook)
            by_hand = model.head(
                model.body.forward(probe) + (inj.trainable(probe) - inj.frozen(probe))
            )
            assert torch.equal(model(probe), by_hand)
        second = session.epoch_end(step=2)
        assert second["remedies/plasticity_injection/body/fired"] == 0.0  # injects once
    assert session.remedies.bound[0].firings == 1


def parse_remedy_spec(spec: str):
    return from_spec(spec, "remedy")[:2]


def test_step_remedy_specs():
    _, r = parse_remedy_spec(
        "continual_backprop@critic_mlp:replacement_rate=0.001,maturity_threshold=100"
    )
    assert (r.replacement_rate, r.maturity_threshold, r.decay) == (0.001, 100, 0.99)
    assert r.trigger is None
    _, r = parse_remedy_spec("l2_init@actor_mlp:coef=0.01,layers=layer_0.linear")
    assert r.coef == 0.01 and r.layers == ["layer_0.linear"]
    _, r = parse_remedy_spec("soft_shrink_perturb@actor_mlp:shrink=0.999,noise=0.001")
    assert (r.shrink, r.noise) == (0.999, 0.001)
    _, r = parse_remedy_spec("plasticity_injection@actor_mlp:every_epochs=5")
    assert r.trigger.every_epochs == 5
    with pytest.raises(ValueError, match="coef must be > 0"):
        parse_remedy_spec("l2_init@a:coef=0")
    with pytest.raises(ValueError, match=r"replacement_rate must be in \(0, 1\]"):
        parse_remedy_spec("continual_backprop@a:replacement_rate=2")
    with pytest.raises(ValueError, match="a remedy needs a trigger"):
        parse_remedy_spec("plasticity_injection@a")


def test_a_remedy_attached_twice_is_refused_before_it_hooks_the_optimizer(
    tmp_path, device: torch.device
):
    torch.manual_seed(4)
    model = ReluNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = remedy_session(tmp_path, model, opt)
    session.add_remedy("body", l2_init(coef=0.5))
    with pytest.raises(ValueError, match="l2_init@body is attached twice"):
        session.add_remedy("body", l2_init(coef=0.5))
    with torch.no_grad():
        for p in model.body.parameters():
            p += 1.0  # theta - theta_0 = 1 everywhere
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    loss_of(model, batches(1, device=device)[0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        term = 0.5 if n.startswith("body.") else 0.0  # once, not twice
        assert torch.allclose(p, before[n] - 0.1 * (grads[n] + term), atol=1e-7), n
