"""Issue 42, items 1-3: the edges of the relu and utility probes a real policy reaches,
each met as a user meets it (a ProbeSession script) and checked against the papers'
formulas written out here with loops, on activations read by plain torch hooks.

* relu ``taus`` closer than ``%g`` prints: one key each (ReDo, Sokar et al. 2023).
* utility on conv nets: the project's CNN policy and a Conv1d stack, channels scored with
  their real outgoing weights (CBP's contribution utility, Dohare et al. 2024).
* utility with a LayerNorm between a ReLU and its reader: refused in one line at attach,
  the other layers scored, training goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import JSONL_ONLY
from torch import nn

from policy_probes import attach_relu_activation_hooks
from policy_probes.probe_settings import ProbeSettings
from policy_probes.probes.relu import tau_key
from policy_probes.probes.utility import attach_utility_hooks
from policy_probes.session import ProbeSession
from policy_probes.user_errors import ProbeError

EVERY_PASS = ProbeSettings(sinks=JSONL_ONLY, probe_budget=None)


def recorder(modules: dict[str, nn.Module]) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Plain torch forward hooks keeping a copy of every output of ``modules``."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    handles = [
        m.register_forward_hook(
            lambda _m, _i, out, name=name: seen[name].append(out.detach().double().clone())
        )
        for name, m in modules.items()
    ]
    return seen, handles


def channel_means(outputs: list[torch.Tensor]) -> list[float]:
    """Mean |h_c| per unit c over every sample and position (units on axis 1 for a conv
    output, on the last axis for a dense one), one element at a time."""
    totals: list[float] = []
    count = 0
    for h in outputs:
        rows = h.movedim(1, -1).reshape(-1, h.shape[1]) if h.dim() >= 3 else h
        if not totals:
            totals = [0.0] * rows.shape[1]
        for row in rows.tolist():
            for c, v in enumerate(row):
                totals[c] += abs(v)
        count += rows.shape[0]
    return [t / count for t in totals]


def running(per_epoch: list[list[float]], decay: float) -> list[float]:
    """CBP's running utility, once per report: u = c_1, then u <- decay u + (1 - decay) c."""
    u = list(per_epoch[0])
    for c in per_epoch[1:]:
        u = [decay * a + (1 - decay) * b for a, b in zip(u, c, strict=True)]
    return u


def low_fraction(u: list[float], tau: float) -> float:
    mean = sum(u) / len(u)
    return sum(1 for x in u if x / (mean + 1e-12) <= tau) / len(u)


# ----------------------------------------------------- item 1: relu taus closer than %g
def test_relu_taus_closer_than_g_prints_get_one_key_each(tmp_path: Path) -> None:
    """taus=(0.1, 0.1000001) print alike with %g; a unit whose ReDo score lies between
    them is dormant at the second threshold only, so the two keys must differ, each equal
    to the fraction computed from the activations."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(1, 4, bias=False), nn.ReLU())
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    torch.manual_seed(0)
    net = Net()
    # mean|h| per unit = w_u for x = 1: unit 0 scores 0.10000005 of the layer mean
    rest = (0.9, 1.0, 2.0)
    s = 0.10000005
    first = s * sum(rest) / (4 - s)
    with torch.no_grad():
        net.body[0].weight.copy_(torch.tensor([[first], *[[r] for r in rest]]))
    net.body[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(net.head.parameters(), lr=0.1)
    taus = (0.1, 0.1000001, 0.025)
    assert f"{taus[0]:g}" == f"{taus[1]:g}"  # the edge: one %g key for two thresholds
    seen, handles = recorder({"h": net.body[1]})
    with ProbeSession(net, run=tmp_path / "r", probing=EVERY_PASS, optimizer=opt) as session:
        session.add_training_hook("body", attach_relu_activation_hooks(taus=taus))
        session.set_phase("train")
        for _ in range(3):
            loss = net(torch.ones(5, 1)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        metrics = session.epoch_end(step=3)
    for h in handles:
        h.remove()
    means = channel_means(seen["h"])
    layer = sum(means) / len(means)
    scores = [m / (layer + 1e-9) for m in means]
    assert 0.1 < scores[0] <= 0.1000001  # the reference puts unit 0 between the two
    for tau in taus:
        want = sum(1 for v in scores if v <= tau) / len(scores)
        for name in ("body", "body.1"):
            assert metrics[f"probes/relu/{name}/dormant_fraction_tau_{tau_key(tau)}"] == want
    assert "probes/relu/body/dormant_fraction_tau_0.1000001" in metrics
    assert metrics["probes/relu/body/dormant_fraction_tau_0.1"] == 0.0
    assert metrics["probes/relu/body/dormant_fraction_tau_0.1000001"] == 0.25
    # the usual thresholds keep their names
    assert [tau_key(t) for t in (0.0, -0.0, 0.025, 0.1, 1.0, 1e-5)] == [
        "0",
        "0",
        "0.025",
        "0.1",
        "1",
        "1e-05",
    ]


def test_relu_taus_given_twice_are_refused_naming_the_threshold() -> None:
    with pytest.raises(ValueError, match=r"taus holds the threshold\(s\) \[0.1\] more than once"):
        attach_relu_activation_hooks(taus=(0.1, 0.025, 0.1))
    with pytest.raises(ValueError, match="more than once"):
        attach_relu_activation_hooks(taus=(0.0, -0.0))


# -------------------------------------------- item 2: utility on the project's CNN policy
def test_utility_scores_the_cnn_policys_conv_channels(tmp_path: Path) -> None:
    """CNNActorCriticPolicy's encoder (NatureCNN on 44x44 frames: conv_2 has 2x2
    positions) over two epochs of training: every conv layer and fc scored, no probe
    fault; each channel's utility = mean|h_c| (samples and positions) x sum of |w| over
    the reader's weights of channel c (conv_1 / conv_2: the next convolution's input
    channel c; conv_2: fc's columns c*4 .. c*4+3 of the flattened map)."""
    from trainers.cnn_policy import CNNActorCriticPolicy

    torch.manual_seed(0)
    space = gym.spaces.Box(0, 255, (4, 44, 44), np.uint8)
    policy = CNNActorCriticPolicy(space, gym.spaces.Discrete(3))
    enc = policy.encoder
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    decay = 0.7
    layers = {"conv_0": enc.conv_0, "conv_1": enc.conv_1, "conv_2": enc.conv_2, "fc": enc.fc}
    seen, handles = recorder(layers)
    g = torch.Generator().manual_seed(2)
    per_epoch: dict[str, list[list[float]]] = {name: [] for name in layers}
    reports = []
    with ProbeSession(policy, run=tmp_path / "r", probing=EVERY_PASS, optimizer=opt) as session:
        session.add_training_hook(
            "encoder", attach_utility_hooks(outgoing="actor_head", decay=decay, reference=False)
        )
        session.set_phase("train")
        for epoch in range(2):
            for out in seen.values():
                out.clear()
            for _ in range(2):
                obs = torch.randint(0, 256, (3, 4, 44, 44), generator=g, dtype=torch.uint8)
                logits, value = policy(obs)
                loss = logits.logsumexp(-1).mean() + value.square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            reports.append(session.epoch_end(step=epoch))
            # the outgoing weights at the report, read one element at a time
            w1 = enc.conv_1.conv.weight.detach().double()
            w2 = enc.conv_2.conv.weight.detach().double()
            fc = enc.fc.linear.weight.detach().double()
            head = policy.actor_head.weight.detach().double()
            positions = fc.shape[1] // 64
            assert positions == 4
            out_mag = {
                "conv_0": [float(w1[:, c].abs().sum()) for c in range(w1.shape[1])],
                "conv_1": [float(w2[:, c].abs().sum()) for c in range(w2.shape[1])],
                "conv_2": [
                    sum(
                        abs(float(fc[k, c * positions + p]))
                        for k in range(fc.shape[0])
                        for p in range(positions)
                    )
                    for c in range(64)
                ],
                "fc": [float(head[:, i].abs().sum()) for i in range(head.shape[1])],
            }
            for name in layers:
                means = channel_means(seen[name])
                per_epoch[name].append([m * w for m, w in zip(means, out_mag[name], strict=True)])
    for h in handles:
        h.remove()
    for got in reports:
        assert not any(k.startswith("probes/errors/") for k in got), got
    for name in layers:
        key = f"probes/utility/encoder.{name}/"
        for epoch, got in enumerate(reports):
            want = running(per_epoch[name][: epoch + 1], decay)
            assert len(got[key + "utility"]) == len(want)
            assert got[key + "utility"] == pytest.approx(want, rel=1e-5, abs=1e-12)
            assert got[key + "contribution_mean"] == pytest.approx(
                sum(per_epoch[name][epoch]) / len(want), rel=1e-5
            )
            assert got[key + "low_utility_fraction"] == pytest.approx(low_fraction(want, 0.025))
    assert len(reports[0]["probes/utility/encoder.conv_0/utility"]) == 32  # channels


# ---------------------------------------------------- item 2: a Conv1d stack, grouped
def test_utility_scores_a_conv1d_stack_per_channel_under_a_row_mask(tmp_path: Path) -> None:
    """Conv1d -> ReLU -> grouped Conv1d -> ReLU -> Flatten -> Linear: channel c of the
    first layer passes on through the grouped conv's weights of its own group only, the
    second layer's channels through the Linear's columns of the channel-major flatten;
    a row mask leaves samples out (every position of a left-out sample)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv1d(3, 4, 3),
                nn.ReLU(),
                nn.Conv1d(4, 6, 3, groups=2),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(6 * 6, 2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    seen, handles = recorder({"body.1": net.body[1], "body.3": net.body[3]})
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    with ProbeSession(net, run=tmp_path / "r", probing=EVERY_PASS, optimizer=opt) as session:
        session.add_training_hook("body", attach_utility_hooks(reference=False))
        session.set_phase("train")
        x = torch.randn(5, 3, 10, generator=g)
        with session.row_mask(mask):
            loss = (net(x).square().sum(-1) * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
        opt.step()
        got = session.epoch_end(step=0)
    for h in handles:
        h.remove()
    keep = mask.bool()
    w2 = net.body[2].weight.detach().double()  # (6, 2, 3): two groups of 2 inputs, 3 outputs
    lin = net.body[5].weight.detach().double()  # (2, 36): channel c owns columns 6c .. 6c+5
    out1 = []
    for c in range(4):
        total = 0.0
        for o in range(6):
            if o // 3 == c // 2:  # output o belongs to input c's group
                total += sum(abs(float(w2[o, c % 2, k])) for k in range(3))
        out1.append(total)
    out3 = [sum(abs(float(v)) for v in lin[:, 6 * c : 6 * c + 6].flatten()) for c in range(6)]
    for name, out_mag in (("body.1", out1), ("body.3", out3)):
        means = channel_means([h[keep] for h in seen[name]])
        want = [m * w for m, w in zip(means, out_mag, strict=True)]
        assert got[f"probes/utility/{name}/utility"] == pytest.approx(want, rel=1e-5, abs=1e-12)
        assert got[f"probes/utility/{name}/low_utility_fraction"] == pytest.approx(
            low_fraction(want, 0.025)
        )
    assert not any(k.startswith("probes/errors/") for k in got)


# -------------------------------------- item 3: a LayerNorm between a ReLU and its reader
class NormedNet(nn.Module):
    """body: Linear, ReLU, Dropout, Linear, ReLU, LayerNorm, Linear, ReLU; head: Linear.
    body.1 is read by body.3 through a dropout (scored), body.4 through a LayerNorm
    (refused), body.7 by the head (scored with outgoing="head")."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(5, 8),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(8, 7),
            nn.ReLU(),
            nn.LayerNorm(7),
            nn.Linear(7, 6),
            nn.ReLU(),
        )
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_utility_refuses_a_layer_norm_between_relu_and_reader_once_and_trains_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    net = NormedNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    seen, handles = recorder({"body.1": net.body[1], "body.7": net.body[7]})
    g = torch.Generator().manual_seed(4)
    reports = []
    with ProbeSession(net, run=tmp_path / "r", probing=EVERY_PASS, optimizer=opt) as session:
        with caplog.at_level(logging.ERROR, logger="policy_probes"):
            session.add_training_hook("body", attach_utility_hooks(outgoing="head", decay=0.5))
        refusals = [r.getMessage() for r in caplog.records if "utility probe" in r.getMessage()]
        assert refusals == [
            "utility probe: body.4 is not scored: body.5 (LayerNorm) runs between it and the "
            "layer that reads it, so no outgoing weights act on its units directly. Only "
            "dropout, nn.Identity or nn.Flatten may run in between (docs/probes/utility.md)"
        ]
        caplog.clear()
        session.set_phase("train")
        per_epoch: dict[str, list[list[float]]] = {"body.1": [], "body.7": []}
        for epoch in range(2):
            for out in seen.values():
                out.clear()
            for _ in range(3):
                loss = net(torch.randn(6, 5, generator=g)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            reports.append(session.epoch_end(step=epoch))
            readers = {"body.1": net.body[3].weight, "body.7": net.head.weight}
            for name, w in readers.items():
                w = w.detach().double()
                mag = [float(w[:, i].abs().sum()) for i in range(w.shape[1])]
                means = channel_means(seen[name])
                per_epoch[name].append([m * x for m, x in zip(means, mag, strict=True)])
    for h in handles:
        h.remove()
    assert not [r for r in caplog.records if "utility probe" in r.getMessage()]  # once only
    for epoch, got in enumerate(reports):  # training went on, the other layers scored
        assert got["probes/errors/utility/body.4"] == 1.0
        assert not any(k.startswith("probes/utility/body.4/") for k in got)
        for name in ("body.1", "body.7"):
            want = running(per_epoch[name][: epoch + 1], 0.5)
            assert got[f"probes/utility/{name}/utility"] == pytest.approx(want, rel=1e-5)


def test_utility_refusal_raises_when_strict_and_an_outgoing_module_starting_with_a_norm(
    tmp_path: Path,
) -> None:
    """strict=True: the refusal raises at attach. outgoing= naming a module whose first
    layer is a norm is refused the same way (it was scored against its first Linear)."""
    net = NormedNet()
    strict = ProbeSettings(sinks=JSONL_ONLY, probe_budget=None, strict=True)
    refusal = r"body\.4 is not scored: body\.5 \(LayerNorm\)"
    with (
        ProbeSession(net, run=tmp_path / "a", probing=strict) as session,
        pytest.raises(ProbeError, match=refusal),
    ):
        session.add_training_hook("body", attach_utility_hooks())
    net.head = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 2))
    with ProbeSession(net, run=tmp_path / "b", probing=EVERY_PASS) as session:
        session.add_training_hook("body", attach_utility_hooks(outgoing="head"))
        session.set_phase("train")
        net(torch.ones(2, 5)).sum().backward()
        session.next_pass()
        got = session.epoch_end(step=0)
    assert "head.0 (LayerNorm) runs between it" in session.context.probe_errors["utility/body.7"]
    assert "probes/utility/body.1/utility" in got
    assert not any(k.startswith("probes/utility/body.7/") for k in got)


def test_utility_conv_window_resumed_from_a_checkpoint_reports_without_another_forward(
    tmp_path: Path,
) -> None:
    """A conv layer read by a Linear after a flatten needs its positions per sample: a
    window saved mid-epoch and loaded into a new session reports the same utilities."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 2, 6, generator=torch.Generator().manual_seed(5))
    with ProbeSession(net, run=tmp_path / "a", probing=EVERY_PASS) as session:
        session.add_training_hook("body", attach_utility_hooks(reference=False))
        session.set_phase("train")
        net(x).sum().backward()
        session.next_pass()
        saved = session.state_dict()
        want = session.epoch_end(step=0)["probes/utility/body.1/utility"]
    with ProbeSession(net, run=tmp_path / "b", probing=EVERY_PASS) as session:
        session.add_training_hook("body", attach_utility_hooks(reference=False))
        session.load_state_dict(saved)
        got = session.epoch_end(step=0)
    assert got["probes/utility/body.1/utility"] == want
    assert not any(k.startswith("probes/errors/") for k in got)


def test_utility_conv_channels_read_after_a_global_pooling_in_forward(tmp_path: Path) -> None:
    """Conv2d -> ReLU, then ``x.mean((2, 3))`` in forward and a Linear with one input per
    channel: channel c's outgoing weights are the Linear's column c."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(2, 5, 3), nn.ReLU())
            self.head = nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x).mean((2, 3)))

    torch.manual_seed(0)
    net = Net()
    seen, handles = recorder({"h": net.body[1]})
    x = torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(6))
    with ProbeSession(net, run=tmp_path / "r", probing=EVERY_PASS) as session:
        session.add_training_hook("body", attach_utility_hooks(outgoing="head"))
        session.set_phase("train")
        net(x).sum().backward()
        session.next_pass()
        got = session.epoch_end(step=0)
    for h in handles:
        h.remove()
    w = net.head.weight.detach().double()
    mag = [sum(abs(float(w[k, c])) for k in range(3)) for c in range(5)]
    want = [m * v for m, v in zip(channel_means(seen["h"]), mag, strict=True)]
    assert got["probes/utility/body.1/utility"] == pytest.approx(want, rel=1e-5, abs=1e-12)
