"""ReDo exactness on Linear, Conv2d (with a conv -> Flatten -> Linear consumer) and LSTM
units, through a CleanRL-style ProbeSession loop.

The scores are recomputed independently from plain forward hooks (numpy), the fresh rows
are replayed with a generator seeded by hand and the layer's own constructor under
``torch.manual_seed``, and every other weight, every other optimiser moment and the
policy's outputs are compared with copies taken before the firing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ReluNet, remedy_seeds, remedy_session, snapshot
from torch import nn

from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.remedies import redo

TAU = 0.1
SEED = 123


def fresh(ctor, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ctor()


class ScoreHooks:
    """Plain forward hooks summing |h| per unit over every training pass (numpy)."""

    def __init__(self, modules: dict[str, nn.Module], unit_axis: dict[str, int], pick=None):
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.handles = []
        for name, module in modules.items():
            self.handles.append(
                module.register_forward_hook(self._hook(name, unit_axis[name], pick))
            )

    def _hook(self, name, axis, pick):
        def hook(_m, _i, out):
            h = (pick(out) if pick else out).detach().double().cpu().numpy()
            h = np.moveaxis(h, axis, -1).reshape(-1, h.shape[axis])
            self.sums[name] = self.sums.get(name, 0) + np.abs(h).sum(0)
            self.counts[name] = self.counts.get(name, 0) + h.shape[0]

        return hook

    def dormant(self, name: str) -> np.ndarray:
        mean_abs = self.sums[name] / self.counts[name]
        score = mean_abs / (mean_abs.mean() + 1e-9)
        assert np.min(np.abs(score - TAU)) > 1e-4  # no unit on the threshold
        return np.flatnonzero(score <= TAU)

    def remove(self):
        for h in self.handles:
            h.remove()


def train_one_epoch(session, model, opt, batches, scores_after=None):
    """Updates on ``batches`` (the probes record them), then snapshots, then epoch_end."""
    session.set_phase("train")
    for x in batches:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return snapshot(model, opt)


def check_rows(after, before, fresh_t, rows, dim=0):
    """Rows ``rows`` (along dim 0) equal ``fresh_t``'s, every other row unchanged bit for bit."""
    keep = np.setdiff1d(np.arange(before.shape[0]), rows)
    assert torch.equal(after[rows], fresh_t[rows])
    assert torch.equal(after[keep], before[keep])


def check_columns_zeroed(after, before, cols) -> torch.Tensor:
    """``after`` is ``before`` with the columns ``cols`` (dormant units' outgoing weights)
    zero; returns that expectation."""
    expected = before.clone()
    expected[:, cols] = 0
    assert torch.equal(after, expected)
    return expected


def check_reset_layer(after, before, fresh_t, rows, cols) -> torch.Tensor:
    """A unit layer after the firing: its dormant rows ``rows`` are ``fresh_t``'s, every
    other row is ``before``'s with the columns ``cols`` (the previous layer's dormant
    units) zero; returns the expectation for the other rows."""
    assert torch.equal(after[rows], fresh_t[rows])
    kept = np.setdiff1d(np.arange(before.shape[0]), rows)
    return check_columns_zeroed(after[kept], before[kept], cols)


def without_dormant_outputs(model: nn.Module, state: dict, columns: dict) -> nn.Module:
    """``model`` with the pre-firing weights ``state`` and the weight columns
    ``columns[name]`` (the dormant units' outgoing weights) zero: what the outputs keep."""
    model.load_state_dict(state)
    with torch.no_grad():
        for name, cols in columns.items():
            model.get_parameter(name)[:, cols] = 0
    return model


def check_moments(opt, param, before, rows=None, cols=None):
    """exp_avg/exp_avg_sq zero exactly at ``rows`` (dim 0) / ``cols`` (dim 1), the rest as
    before; ``step`` unchanged."""
    state = opt.state[param]
    for key in ("exp_avg", "exp_avg_sq"):
        expected = before[key].clone()
        if rows is not None and len(rows):
            expected[rows] = 0
        if cols is not None and len(cols):
            expected[:, cols] = 0
        assert torch.equal(state[key], expected), key
        assert torch.isfinite(state[key]).all()
    assert torch.equal(state["step"], before["step"])


def session_for(model, tmp_path, component, consumer, tau=TAU, **placement):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = remedy_session(tmp_path, model, opt)
    session.add_training_hook(component, attach_relu_activation_hooks(), **placement)
    session.add_remedy(component, redo(tau=tau, every_epochs=1, consumer=consumer, seed=SEED))
    return session, opt


def test_redo_linear_units_exact(tmp_path, device: torch.device):
    torch.manual_seed(0)
    model = ReluNet()
    with torch.no_grad():
        model.body[0].bias[[1, 4]] = -100.0  # dead units
        model.body[0].weight[7] *= 0.02  # a weak unit: dormant but not dead
        model.body[0].bias[7] = 0.0
        model.body[2].bias[[0, 5]] = -100.0
    model.to(device)
    session, opt = session_for(model, tmp_path, "body", "head")
    hooks = ScoreHooks({"l0": model.body[1], "l1": model.body[3]}, {"l0": -1, "l1": -1})
    batches = [torch.randn(64, 5).to(device) for _ in range(3)]
    with session:
        before, moments = train_one_epoch(session, model, opt, batches)
        hooks.remove()
        d0, d1 = hooks.dormant("l0"), hooks.dormant("l1")
        assert 7 in d0 and {1, 4} <= set(d0) and {0, 5} <= set(d1) and len(d0) < 16
        x_test = torch.randn(256, 5).to(device)
        with session.phase("eval"), torch.no_grad():  # not a training pass: not scored
            out_before = model(x_test)
            columns = {"body.2.weight": d0, "head.weight": d1}
            out_reference = without_dormant_outputs(ReluNet().to(device), before, columns)(x_test)
        metrics = session.epoch_end(step=1)

    s0, s1 = remedy_seeds(SEED, "redo", "body", 2)
    # the remedy draws its fresh values on the CPU (its own CPU generator, then moved)
    f0 = fresh(lambda: nn.Linear(5, 16), s0).to(device)
    f1 = fresh(lambda: nn.Linear(16, 12), s1).to(device)
    p = dict(model.named_parameters())
    check_rows(p["body.0.weight"].detach(), before["body.0.weight"], f0.weight.detach(), d0)
    check_rows(p["body.0.bias"].detach(), before["body.0.bias"], f0.bias.detach(), d0)
    # layer 1: its dormant rows are fresh (whole rows); in the other rows the columns of
    # layer 0's dormant units are zero and everything else unchanged
    check_reset_layer(
        p["body.2.weight"].detach(), before["body.2.weight"], f1.weight.detach(), d1, d0
    )
    check_rows(p["body.2.bias"].detach(), before["body.2.bias"], f1.bias.detach(), d1)
    check_columns_zeroed(p["head.weight"].detach(), before["head.weight"], d1)
    assert torch.equal(p["head.bias"].detach(), before["head.bias"])

    check_moments(opt, p["body.0.weight"], moments["body.0.weight"], rows=d0)
    check_moments(opt, p["body.0.bias"], moments["body.0.bias"], rows=d0)
    # layer 1's weight: rows of its dormant units and columns of layer 0's
    check_moments(opt, p["body.2.weight"], moments["body.2.weight"], rows=d1, cols=d0)
    check_moments(opt, p["head.weight"], moments["head.weight"], cols=d1)
    check_moments(opt, p["head.bias"], moments["head.bias"])

    with torch.no_grad():
        out_after = model(x_test)
    assert torch.equal(out_after, out_reference)  # exactly what the outputs keep
    # the weak unit's small contribution (score <= tau) is all that is dropped
    assert 0 < (out_after - out_before).abs().max() < 1e-2
    assert all(torch.isfinite(v).all() for v in model.parameters())
    assert metrics["remedies/redo/body/fired"] == 1.0
    assert metrics["remedies/redo/body.1/units_reset"] == len(d0)
    assert metrics["remedies/redo/body.3/units_reset"] == len(d1)
    assert metrics["remedies/redo/body/units_reset"] == len(d0) + len(d1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(2, 6, 3),
            nn.ReLU(),
            nn.Conv2d(6, 5, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(5 * 4 * 4, 7),
            nn.ReLU(),
        )
        self.head = nn.Linear(7, 2)

    def forward(self, x):
        return self.head(self.enc(x))


def test_redo_conv_channels_and_flatten_consumer_exact(tmp_path, device: torch.device):
    torch.manual_seed(1)
    model = ConvNet()
    with torch.no_grad():
        model.enc[0].bias[[2]] = -100.0
        model.enc[2].bias[[1, 3]] = -100.0
        model.enc[5].bias[[4]] = -100.0
    model.to(device)
    session, opt = session_for(model, tmp_path, "enc", "head")
    mods = {"c0": model.enc[1], "c1": model.enc[3], "fc": model.enc[6]}
    hooks = ScoreHooks(mods, {"c0": 1, "c1": 1, "fc": -1})
    batches = [torch.randn(16, 2, 8, 8).to(device) for _ in range(2)]
    with session:
        before, moments = train_one_epoch(session, model, opt, batches)
        hooks.remove()
        d0, d1, d2 = hooks.dormant("c0"), hooks.dormant("c1"), hooks.dormant("fc")
        assert {2} <= set(d0) and {1, 3} <= set(d1) and {4} <= set(d2)
        x_test = torch.randn(32, 2, 8, 8).to(device)
        cols = (d1[:, None] * 16 + np.arange(16)).reshape(-1)  # each channel's 4x4 positions
        with session.phase("eval"), torch.no_grad():  # not a training pass: not scored
            out_before = model(x_test)
            columns = {"enc.2.weight": d0, "enc.5.weight": cols, "head.weight": d2}
            out_reference = without_dormant_outputs(ConvNet().to(device), before, columns)(x_test)
        metrics = session.epoch_end(step=1)

    seeds = remedy_seeds(SEED, "redo", "enc", 3)
    f0 = fresh(lambda: nn.Conv2d(2, 6, 3), seeds[0]).to(device)
    f1 = fresh(lambda: nn.Conv2d(6, 5, 3), seeds[1]).to(device)
    f2 = fresh(lambda: nn.Linear(80, 7), seeds[2]).to(device)
    p = dict(model.named_parameters())
    check_rows(p["enc.0.weight"].detach(), before["enc.0.weight"], f0.weight.detach(), d0)
    check_rows(p["enc.0.bias"].detach(), before["enc.0.bias"], f0.bias.detach(), d0)
    # out-channels d1 fresh; in-channels d0 zero elsewhere
    check_reset_layer(
        p["enc.2.weight"].detach(), before["enc.2.weight"], f1.weight.detach(), d1, d0
    )
    expected = check_reset_layer(
        p["enc.5.weight"].detach(), before["enc.5.weight"], f2.weight.detach(), d2, cols
    )
    assert (expected != 0).sum() > 0
    check_columns_zeroed(p["head.weight"].detach(), before["head.weight"], d2)

    check_moments(opt, p["enc.0.weight"], moments["enc.0.weight"], rows=d0)
    check_moments(opt, p["enc.0.bias"], moments["enc.0.bias"], rows=d0)
    check_moments(opt, p["enc.5.weight"], moments["enc.5.weight"], rows=d2, cols=cols)
    check_moments(opt, p["head.weight"], moments["head.weight"], cols=d2)

    with torch.no_grad():
        out_after = model(x_test)
    # conv kernels may sum the zero terms in another order: tight, not bitwise
    assert torch.allclose(out_after, out_reference, rtol=1e-6, atol=1e-6)
    assert (out_after - out_before).abs().max() < 0.05  # a weak fc unit's part is dropped
    assert metrics["remedies/redo/enc.1/units_reset"] == len(d0)
    assert metrics["remedies/redo/enc.3/units_reset"] == len(d1)
    assert metrics["remedies/redo/enc.6/units_reset"] == len(d2)


class RecurrentNet(nn.Module):
    def __init__(self, cls: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.rnn = cls(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


# LSTM: output gate (4th block) shut, h_u = o_u * tanh(c_u) ~ 0; GRU: update gate (2nd
# block) open, h_u = z_u * h_u(previous) + (1 - z_u) * n_u = 0 from h_0 = 0
@pytest.mark.parametrize(
    ("cls", "gates", "gate", "bias"), [(nn.LSTM, 4, 3, -100.0), (nn.GRU, 3, 1, 100.0)]
)
def test_redo_recurrent_units_exact(tmp_path, cls, gates, gate, bias, device: torch.device):
    torch.manual_seed(2)
    model = RecurrentNet(cls)
    hidden, dormant_units = 6, [1, 4]
    with torch.no_grad():
        for u in dormant_units:
            model.rnn.bias_ih_l0[gate * hidden + u] = bias
    model.to(device)
    session, opt = session_for(model, tmp_path, "rnn", "head", extractor=0)
    hooks = ScoreHooks({"rnn": model.rnn}, {"rnn": -1}, pick=lambda out: out[0])
    batches = [torch.randn(8, 5, 4).to(device) for _ in range(2)]
    with session:
        before, moments = train_one_epoch(session, model, opt, batches)
        hooks.remove()
        d = hooks.dormant("rnn")
        assert list(d) == dormant_units
        x_test = torch.randn(16, 5, 4).to(device)
        with session.phase("eval"), torch.no_grad():  # not a training pass: not scored
            out_before = model(x_test)
        metrics = session.epoch_end(step=1)

    (seed,) = remedy_seeds(SEED, "redo", "rnn", 1)
    f = fresh(lambda: cls(4, 6, batch_first=True), seed).to(device)
    rows = np.concatenate([d + g * hidden for g in range(gates)])
    p = dict(model.named_parameters())
    for name in ("weight_ih_l0", "bias_ih_l0", "bias_hh_l0"):
        full = f"rnn.{name}"
        check_rows(p[full].detach(), before[full], getattr(f, name).detach(), rows)
        check_moments(opt, p[full], moments[full], rows=rows)
    # weight_hh: the gate rows are fresh except column u (the unit's outgoing), zero
    whh = p["rnn.weight_hh_l0"].detach()
    expected = before["rnn.weight_hh_l0"].clone()
    expected[rows] = f.weight_hh_l0.detach()[rows]
    expected[:, d] = 0
    assert torch.equal(whh, expected)
    check_moments(opt, p["rnn.weight_hh_l0"], moments["rnn.weight_hh_l0"], rows=rows, cols=d)
    check_columns_zeroed(p["head.weight"].detach(), before["head.weight"], d)
    check_moments(opt, p["head.weight"], moments["head.weight"], cols=d)

    with torch.no_grad():
        out_after = model(x_test)
    assert torch.allclose(out_after, out_before, rtol=1e-6, atol=1e-7)
    assert metrics["remedies/redo/rnn/units_reset"] == len(d)


def redo_after_one_step(policy, tmp_path, component: str, x: torch.Tensor, lr: float):
    """One Adam step (learning rate ``lr``) on the squared logits and value of ``x``, then
    ReDo with tau = 0 on ``component`` at the epoch's end; returns the epoch's metrics and
    the policy's outputs on ``x`` before and after the firing."""
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    with remedy_session(tmp_path, policy, opt) as session:
        session.add_training_hook(component, attach_relu_activation_hooks())
        session.add_remedy(component, redo(tau=0.0, every_epochs=1))
        session.set_phase("train")
        logits, value = policy(x)
        opt.zero_grad()
        (logits.pow(2).mean() + value.pow(2).mean()).backward()
        opt.step()
        with session.phase("eval"), torch.no_grad():
            before = policy(x)
        metrics = session.epoch_end(step=1)
        with session.phase("eval"), torch.no_grad():
            after = policy(x)
    return metrics, before, after


def test_redo_keeps_outputs_of_the_builtin_policy(tmp_path, device: torch.device):
    """ReDo on both MLPs of the built-in ActorCriticPolicy (consumers from its
    component_consumers): outputs unchanged where the recycled units are dead."""
    import gymnasium as gym

    from trainers.config import PolicyConfig
    from trainers.policy import ActorCriticPolicy

    torch.manual_seed(3)
    obs = gym.spaces.Box(-1, 1, (4,))
    policy = ActorCriticPolicy(obs, gym.spaces.Discrete(2), PolicyConfig(activation="relu"))
    with torch.no_grad():
        policy.critic_mlp.layer_0.linear.bias[:5] = -100.0
        policy.actor_mlp.layer_1.linear.bias[:3] = -100.0
    policy.to(device)
    metrics, before, after = redo_after_one_step(
        policy, tmp_path, "*_mlp", torch.randn(32, 4).to(device), 1e-3
    )
    assert metrics["remedies/redo/critic_mlp.layer_0/units_reset"] >= 5
    assert metrics["remedies/redo/actor_mlp.layer_1/units_reset"] >= 3
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_redo_without_dormant_units_changes_nothing(tmp_path, device: torch.device):
    torch.manual_seed(4)
    model = ReluNet().to(device)
    session, opt = session_for(model, tmp_path, "body", "head", tau=0.0)
    with session:
        with torch.no_grad():
            for layer in (model.body[0], model.body[2]):
                layer.bias.fill_(5.0)  # every unit active on every input
        before, _ = train_one_epoch(session, model, opt, [torch.randn(32, 5).to(device)])
        metrics = session.epoch_end(step=1)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
    assert metrics["remedies/redo/body/fired"] == 1.0
    assert metrics["remedies/redo/body/units_reset"] == 0.0


def test_redo_on_the_nature_cnn_encoder_with_two_consumers(tmp_path, device: torch.device):
    """The CNN policy's encoder feeds both heads (component_consumers): ReDo zeroes the
    outgoing columns in both, conv channels through the flattened fc input."""
    import gymnasium as gym

    from trainers.cnn_policy import CNNActorCriticPolicy

    torch.manual_seed(6)
    policy = CNNActorCriticPolicy(
        gym.spaces.Box(0, 255, (1, 36, 36), dtype=np.uint8), gym.spaces.Discrete(3)
    )
    enc = policy.encoder
    with torch.no_grad():
        enc.conv_2.conv.bias[[5, 9]] = -100.0  # dead channels of the last conv
        enc.fc.linear.bias[[0, 7]] = -100.0  # dead features
    policy.to(device)
    # lr=0: the step builds Adam's state and leaves the weights as the scored pass saw
    # them, so the units dead there (score 0) are dead on x and the outputs must be kept
    x = torch.randint(0, 256, (8, 1, 36, 36), dtype=torch.uint8).to(device)
    seen = []  # fc's outputs: the training pass first
    handle = enc.fc.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    metrics, before, after = redo_after_one_step(policy, tmp_path, "encoder", x, 0.0)
    handle.remove()
    assert metrics["remedies/redo/encoder.conv_2/units_reset"] >= 2
    assert metrics["remedies/redo/encoder.fc/units_reset"] >= 2
    # fc units dead on the training pass (score 0 <= tau = 0) get fresh whole rows; in
    # the other rows the flattened columns of the dead channels are zero
    dead_fc = (seen[0] == 0).all(0)
    assert dead_fc[[0, 7]].all() and not dead_fc.all()
    positions = enc.fc.linear.in_features // 64
    for c in (5, 9):
        assert not enc.fc.linear.weight[~dead_fc, c * positions : (c + 1) * positions].any()
    for head in (policy.actor_head, policy.critic_head):
        assert not head.weight[:, [0, 7]].any()
    assert torch.allclose(before[0], after[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(before[1], after[1], rtol=1e-5, atol=1e-6)


def test_redo_on_a_probe_threshold_and_without_per_layer_scores(
    tmp_path, caplog, device: torch.device
):
    """``when=`` on the probe's own dormant fraction; with ``per_layer=False`` only the
    last layer has scores (the component's): the first is left alone, with a warning."""
    torch.manual_seed(8)
    model = ReluNet()
    with torch.no_grad():
        model.body[0].bias[[2, 3]] = -100.0  # dead in layer 0 (not scored)
        model.body[2].bias[[0, 5, 6]] = -100.0  # dead in layer 1 (the component's output)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = remedy_session(tmp_path, model, opt)
    session.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
    key = "probes/relu/body/dormant_fraction"
    session.add_remedy("body", redo(tau=0.0, when=f"{key}>0.2", consumer="head", seed=SEED))
    seen = []
    model.body.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    with session, caplog.at_level("WARNING", logger="policy_probes"):
        before, _ = train_one_epoch(session, model, opt, [torch.randn(32, 5).to(device)])
        first = session.epoch_end(step=1)
        train_one_epoch(session, model, opt, [torch.randn(32, 5).to(device)])
        second = session.epoch_end(step=2)
    dead = torch.nonzero((seen[0] == 0).all(0)).reshape(-1)  # score 0 <= tau = 0
    assert {0, 5, 6} <= set(dead.cpu().tolist()) and len(dead) < 12
    assert first[key] == len(dead) / 12 > 0.2 and first["remedies/redo/body/fired"] == 1.0
    assert first["remedies/redo/body.3/units_reset"] == len(dead)
    assert first["remedies/redo/body.1/units_reset"] == 0.0
    assert torch.equal(model.body[0].bias.detach()[[2, 3]], before["body.0.bias"][[2, 3]])
    assert "no dormant scores for body.1" in caplog.text
    assert second["remedies/redo/body/fired"] == float(second[key] > 0.2)
