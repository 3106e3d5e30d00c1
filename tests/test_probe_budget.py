"""The default schedule and the overhead budget: every epoch observes and reports every
probe (passes 0, k, 2k, ... of each epoch); the budget is checked once, at the end of the
calibration epoch, and the strides it chooses are kept (config.json, checkpoints);
``probe_budget=None`` observes every pass.

Costs run on a fake clock (``time.perf_counter`` replaced by a counter the test advances):
the loop's "training" work, a slow hook, drain or sink advance it by fixed amounts and
everything else takes no time, so what the sampler measures, and what it chooses, is the
same on any machine and under any load. No assertion reads the real clock.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time

import pytest
import torch
from conftest import NO_WANDB
from torch import nn

from policy_probes import ProbeSettings, Run, attach_relu_activation_hooks
from policy_probes.probes.relu import ReLUActivation
from policy_probes.sampling import CALIBRATION_EPOCH, DEFAULT_STRIDE, Sampler, dispatch_costs
from policy_probes.session import ProbeSession

PASSES = 32
STEP_SECONDS = 0.004
PROBE_SECONDS = 0.015


class FakeClock:
    """``time.perf_counter`` that moves only when :meth:`advance` is called."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    dispatch_costs()  # measured once per process on the real clock, before the fake one
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.slow = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.cheap = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cheap(self.slow(x)).sum()


def slow_relu_hooks(clock: FakeClock) -> ReLUActivation:
    """The ReLU probe with a hook that takes PROBE_SECONDS per call."""

    class Slow(ReLUActivation):
        def record(self, obs, module: nn.Module, output: torch.Tensor, weight) -> None:
            clock.advance(PROBE_SECONDS)
            super().record(obs, module, output, weight)

    return Slow()


def slow_and_cheap(clock: FakeClock):
    """The slow ReLU probe on ``slow``, the tanh saturation probe on ``cheap``."""
    from policy_probes import attach_saturated_activation_hooks

    def attach(session: ProbeSession) -> None:
        session.add_training_hook("slow", slow_relu_hooks(clock), per_layer=False)
        session.add_training_hook("cheap", attach_saturated_activation_hooks(), per_layer=False)

    return attach


def run(tmp_path, clock, budget, epochs, attach=None, passes=PASSES, step=STEP_SECONDS, seen=None):
    """``epochs`` epochs of ``passes`` SGD passes on Net, each followed by ``step`` fake
    seconds of the loop's own work, with the probes of ``attach``; the epoch records.
    ``seen``: a list that gets, per epoch, the indices of the passes the probes observed."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    records = []
    attach = attach or slow_and_cheap(clock)
    with ProbeSession(
        net,
        optimizer=opt,
        run=Run(tmp_path),
        probing=ProbeSettings(probe_budget=budget, **NO_WANDB),
    ) as s:
        attach(s)
        for epoch in range(epochs):
            s.set_phase("train")
            observed = []
            for i in range(passes):
                if s.policy.hooks_installed():
                    observed.append(i)
                opt.zero_grad()
                net(x).backward()
                opt.step()
                clock.advance(step)  # the loop's own work
            if seen is not None:
                seen.append(observed)
            records.append(s.epoch_end(step=epoch))
    return records


def test_the_default_observes_passes_0_k_2k_of_every_epoch_and_reports_every_epoch(tmp_path, clock):
    seen: list[list[int]] = []
    records = run(tmp_path, clock, 0.05, epochs=5, step=1.0, seen=seen)  # cheap probes
    assert seen == [list(range(0, PASSES, DEFAULT_STRIDE))] * 5
    for r in records:
        for key in ("relu/slow", "saturation_tanh/cheap"):
            assert r[f"probes/{key}/passes_observed"] == PASSES // DEFAULT_STRIDE
            assert r[f"probes/{key}/rows_observed"] == 16 * PASSES // DEFAULT_STRIDE
        assert r["probes/relu/slow/samples"] == 16 * PASSES // DEFAULT_STRIDE
        assert r["probes/relu/observe_every"] == DEFAULT_STRIDE
        assert "probes/window_epochs" not in r  # no reporting windows any more
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["probe_sampling"] == {
        "budget": 0.05,
        "calibrated_epoch": CALIBRATION_EPOCH,
        "observe_every": {"relu": DEFAULT_STRIDE, "saturation_tanh": DEFAULT_STRIDE},
    }


def test_an_expensive_probe_is_sampled_down_once_at_calibration(tmp_path, clock):
    """32 passes of 4 ms and a probe hook of 15 ms: at the default stride (2 passes per
    epoch) the slow probe costs 30 ms against an allowance of AIM x b / (1 - b) x 128 ms =
    21 ms under a 25 % budget; the calibration doubles its stride (one pass, 15 ms) and
    leaves the cheap probe's. The choice is kept for the rest of the run."""
    records = run(tmp_path, clock, 0.25, epochs=6)
    for epoch, r in enumerate(records):
        calibrated = epoch > CALIBRATION_EPOCH
        k = 2 * DEFAULT_STRIDE if calibrated else DEFAULT_STRIDE
        assert r["probes/relu/slow/passes_observed"] == math.ceil(PASSES / k)
        assert r["probes/saturation_tanh/cheap/passes_observed"] == PASSES // DEFAULT_STRIDE
        # the report of the calibration epoch already carries the choice
        assert r["probes/relu/observe_every"] == (
            2 * DEFAULT_STRIDE if epoch >= CALIBRATION_EPOCH else DEFAULT_STRIDE
        )
        assert r["probes/saturation_tanh/observe_every"] == DEFAULT_STRIDE
        assert r["probes/relu/slow/samples"] == 16 * math.ceil(PASSES / k)
    # the slow hook's fake seconds are in the overhead (one or two calls per epoch)
    assert records[-1]["probes/overhead_seconds"] >= PROBE_SECONDS
    assert records[-1]["probes/overhead_seconds"] < PROBE_SECONDS + 0.005
    choice = json.loads((tmp_path / "config.json").read_text())["probe_sampling"]
    assert choice["observe_every"] == {"relu": 2 * DEFAULT_STRIDE, "saturation_tanh": 16}


def test_a_budget_one_pass_per_epoch_cannot_meet_keeps_every_epoch_and_warns(
    tmp_path, clock, caplog
):
    """A 15 ms hook against epochs of 32 x 0.1 ms: no stride meets 5 %, so each probe
    observes one pass in every epoch (never fewer epochs) and a warning says so."""
    with caplog.at_level(logging.WARNING, logger="policy_probes"):
        records = run(tmp_path, clock, 0.05, epochs=4, step=0.0001)
    (message,) = [m for m in caplog.messages if "every epoch is still observed" in m]
    # where the time goes, largest first: the slow probe's one pass of the calibration
    # epoch's time (its record's overhead seconds over its fraction)
    calibration = records[CALIBRATION_EPOCH]
    wall = calibration["probes/overhead_seconds"] / calibration["probes/overhead_fraction"]
    share = re.search(r"\(observed passes ([\d.]+) %, report ", message)
    assert share is not None, message
    assert float(share.group(1)) == pytest.approx(100 * PROBE_SECONDS / wall, abs=0.15)
    for r in records[CALIBRATION_EPOCH + 1 :]:
        assert r["probes/relu/slow/passes_observed"] == 1
        assert r["probes/relu/observe_every"] >= PASSES


def test_the_choice_is_carried_by_state_dict(clock):
    """A sampler that loads another's state keeps its strides and does not calibrate
    again (resume and fork reuse the choice)."""
    from policy_probes import ComponentContext

    saved = Sampler(ComponentContext(), budget=0.05)
    saved.observe_every = {"relu": 64}
    saved.calibrated_epoch = 1
    saved.epochs = 3
    state = saved.state_dict()
    loaded = Sampler(ComponentContext(), budget=0.05)
    loaded.load_state_dict(json.loads(json.dumps(state)))  # plain values, as checkpoints hold
    assert loaded.observe_every == {"relu": 64}
    assert loaded.calibrated_epoch == 1


def test_no_budget_observes_every_pass(tmp_path, clock):
    records = run(tmp_path, clock, None, epochs=2)
    for r in records:
        assert r["probes/relu/slow/passes_observed"] == PASSES
        assert r["probes/relu/slow/samples"] == 16 * PASSES
        assert r["probes/saturation_tanh/cheap/passes_observed"] == PASSES
        assert "probes/relu/observe_every" not in r
        # 32 x 15 ms of hooks against 32 x 4 ms of training: measured, not limited
        assert r["probes/overhead_fraction"] == pytest.approx(15 / 19, abs=0.02)


def test_the_overhead_counts_the_hook_time_it_measures(tmp_path, clock):
    """The slow hook's fake seconds are the reported overhead (32 x 15 ms, plus the
    estimated hook dispatch, microseconds per call), and its parts say where: all of it
    in the slow probe's observed passes."""
    (record,) = run(tmp_path, clock, None, epochs=1)
    assert record["probes/overhead_seconds"] == pytest.approx(PASSES * PROBE_SECONDS, abs=0.005)
    prefix = "probes/overhead_seconds/"
    parts = {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)}
    assert set(parts) == {
        "passes.relu",
        "passes.saturation_tanh",
        "report",
        "arming",
        "sampler",
        "records",
    }
    assert sum(parts.values()) == pytest.approx(record["probes/overhead_seconds"], rel=1e-12)
    assert parts["passes.relu"] == pytest.approx(PASSES * PROBE_SECONDS, abs=0.005)
    for part in ("passes.saturation_tanh", "report", "arming", "sampler", "records"):
        assert parts[part] == pytest.approx(0.0, abs=0.002), part


def test_sampler_alone_on_a_context_without_a_session():
    from policy_probes import ComponentContext, PolicyAutoBuilder

    policy = PolicyAutoBuilder.wrap(Net())
    context = ComponentContext()
    sampler = Sampler(context, schedule="every_k:2", budget=None)
    policy.attach("slow", attach_relu_activation_hooks(), context, per_layer=False)
    x = torch.randn(5, 4)
    armed = []
    for _ in range(4):
        armed.append(policy.hooks_installed())
        policy(x)
        sampler.next_pass()
    assert armed == [True, False, True, False]
    assert sampler.totals() == {"relu/slow": (2, 10)}


DRAIN_SECONDS = 0.02


def slow_drain(clock: FakeClock) -> type:
    class SlowDrain(ReLUActivation):
        """The ReLU tracker whose reduction of held rows takes DRAIN_SECONDS."""

        def consume(self, batch):
            clock.advance(DRAIN_SECONDS)
            super().consume(batch)

    return SlowDrain


def test_a_drain_inside_a_hook_is_counted_once(tmp_path, clock):
    """A full row buffer drains inside the probe's hook: the hook's timing counts that
    drain, so the tracker's own drain time must not count it again. The metric still
    rests on every observed row: its active rate equals a plain recomputation."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # the weights stay, for the check below
    x = torch.randn(16, 4)
    with ProbeSession(
        net, optimizer=opt, run=Run(tmp_path), probing=ProbeSettings(probe_budget=None, **NO_WANDB)
    ) as s:
        s.add_training_hook("slow", attach_relu_activation_hooks(), per_layer=False)
        (tracker,) = [t for t in s.context.model_metrics.values() if t.probe == "relu"]
        tracker.__class__ = slow_drain(clock)
        tracker.buffer_rows = 16  # one pass fills the buffer: each next push drains first
        s.set_phase("train")
        for _ in range(4):
            opt.zero_grad()
            net(x).backward()
            opt.step()
        assert tracker.seconds == 0.0  # the three in-hook drains are the hook's cost
        record = s.epoch_end(step=0)
    # three drains in the hooks and one at the report: 4 x 20 ms (7 x if counted twice)
    assert record["probes/overhead_seconds"] == pytest.approx(4 * DRAIN_SECONDS, abs=0.002)
    # the hooks' drains are the observed passes' cost, the last one the report's
    passes = record["probes/overhead_seconds/passes.relu"]
    assert passes == pytest.approx(3 * DRAIN_SECONDS, abs=0.002)
    assert record["probes/overhead_seconds/report"] == pytest.approx(DRAIN_SECONDS, abs=0.002)
    active = (net.slow(x) > 0).double().mean(0)  # the same rows in every pass
    assert record["probes/relu/slow/samples"] == 64
    assert record["probes/relu/slow/active_rate"] == pytest.approx(active.tolist())


SINK_SECONDS = 0.05


def test_the_epoch_end_beyond_the_collection_counts_without_lifecycle_hooks(tmp_path, clock):
    """A session has no lifecycle hook by default (SB3's callback, loops of your own): its
    epoch end beyond collecting the trackers (the record written to the sinks, here a sink
    taking SINK_SECONDS per record) is the probes' reporting, counted in the next epoch's
    overhead."""

    def cheap_probe_and_slow_sink(session: ProbeSession) -> None:
        assert not session.hooks.hooks
        session.add_training_hook("cheap", attach_relu_activation_hooks(), per_layer=False)
        emit = session.sinks.emit

        def slow_emit(*args, **kwargs):
            clock.advance(SINK_SECONDS)
            return emit(*args, **kwargs)

        session.sinks.emit = slow_emit

    records = run(tmp_path, clock, None, 2, attach=cheap_probe_and_slow_sink, passes=4, step=0.0)
    assert records[0]["probes/overhead_seconds"] == pytest.approx(0.0, abs=0.002)
    assert records[1]["probes/overhead_seconds"] == pytest.approx(SINK_SECONDS, abs=0.002)
    # that part is the records' (the previous epoch's end), none of it the report's
    assert records[0]["probes/overhead_seconds/records"] == 0.0
    sinks = records[1]["probes/overhead_seconds/records"]
    assert sinks == pytest.approx(SINK_SECONDS, abs=0.002)
    assert records[1]["probes/overhead_seconds/report"] == pytest.approx(0.0, abs=0.002)
    assert records[1]["probes/relu/cheap/passes_observed"] == 4
