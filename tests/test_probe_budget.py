"""The overhead budget: an expensive probe is sampled down until the measured overhead is
within the budget, the most expensive probe first; ``probe_budget=None`` observes all.

The costs are made deterministic with ``time.sleep`` (the loop's "training" work and the
expensive probe's hook), so what the sampler measures does not depend on this machine's
speed; the assertions compare the sampler's own measurements with the budget.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from policy_probes import attach_relu_activation_hooks
from policy_probes.probes.relu import ReLUActivationHook, ReLUActivationState
from policy_probes.sampling import FIRST_EVERY, MAX_REPORT_WINDOW, Sampler, dispatch_costs
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig

NO_WANDB = dict(sinks=SinksConfig(console=False, wandb=False), wandb=WandbConfig(mode="disabled"))
PASSES = 32
STEP_SECONDS = 0.004
PROBE_SECONDS = 0.015


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.slow = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.cheap = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cheap(self.slow(x)).sum()


def slow_relu_hooks():
    """The ReLU probe with a hook that takes PROBE_SECONDS per call."""
    inner = attach_relu_activation_hooks(per_layer=False)

    class Slow(ReLUActivationHook):
        probe = "relu"

        def record(self, module: nn.Module, output: torch.Tensor) -> None:
            time.sleep(PROBE_SECONDS)
            super().record(module, output)

    def build(name, context):
        hook = inner(name, context)
        if hook is not None:
            hook.__class__ = Slow
        return hook

    return build


def slow_and_cheap(session: ProbeSession) -> None:
    """The slow ReLU probe on ``slow``, the tanh saturation probe on ``cheap``."""
    from policy_probes import attach_saturated_activation_hooks

    session.add_training_hook("slow", slow_relu_hooks())
    session.add_training_hook("cheap", attach_saturated_activation_hooks(per_layer=False))


def run(tmp_path, budget, epochs, attach=slow_and_cheap, passes=PASSES, step=STEP_SECONDS):
    """``epochs`` epochs of ``passes`` SGD passes on Net, each followed by ``step`` seconds
    of the loop's own work, with the probes of ``attach``; the epoch records."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    records = []
    with ProbeSession(net, run_dir=tmp_path, optimizer=opt, probe_budget=budget, **NO_WANDB) as s:
        attach(s)
        for epoch in range(epochs):
            s.set_phase("train")
            for _ in range(passes):
                opt.zero_grad()
                net(x).backward()
                opt.step()
                time.sleep(step)  # the loop's own work
            records.append(s.epoch_end(step=epoch))
    return records


def test_an_expensive_probe_is_sampled_down_within_the_budget(tmp_path):
    budget = 0.25
    # 10 ms of the loop's own work per pass: an epoch's allowance (~50 ms) holds the report
    # (a few ms, more on a loaded machine) and one or more of the slow probe's passes
    records = run(tmp_path, budget, epochs=6, step=0.01)
    first = records[0]
    # epoch 1, before any cost is known, observes every FIRST_EVERY-th pass
    assert first["probes/relu/slow/passes_observed"] == max(PASSES // FIRST_EVERY, 1)
    assert first["probes/window_epochs"] == 1
    # then the expensive probe is sampled down (more than the cheap one) until the
    # measured overhead is within the budget, and it stays there
    for r in records[3:]:
        assert r["probes/overhead_fraction"] <= budget
        assert r["probes/relu/observe_every"] >= 2
        assert r["probes/relu/observe_every"] >= r["probes/saturation_tanh/observe_every"]
        k = int(r["probes/relu/observe_every"])
        observed = r.get("probes/relu/slow/passes_observed", 0)  # absent: none this epoch
        assert observed == PASSES // k if k <= PASSES else observed <= 1
    last = next(r for r in reversed(records) if "probes/relu/slow/passes_observed" in r)
    assert last["probes/relu/slow/rows_observed"] == 16 * last["probes/relu/slow/passes_observed"]
    assert last["probes/relu/slow/samples"] == last["probes/relu/slow/rows_observed"]


def test_no_budget_observes_every_pass(tmp_path):
    records = run(tmp_path, None, epochs=2)
    for r in records:
        assert r["probes/relu/slow/passes_observed"] == PASSES
        assert r["probes/relu/slow/samples"] == 16 * PASSES
        assert r["probes/saturation_tanh/cheap/passes_observed"] == PASSES
        assert "probes/relu/observe_every" not in r
        assert r["probes/overhead_fraction"] > 0.2  # measured, not limited


def test_the_overhead_counts_the_hook_time_it_measures(tmp_path):
    """The slow hook's sleeps are in the reported overhead seconds (32 x 15 ms at least), and
    the calibrated dispatch costs are plausible (under a millisecond per hook)."""
    (record,) = run(tmp_path, None, epochs=1)
    assert record["probes/overhead_seconds"] >= PASSES * PROBE_SECONDS
    module_cost, tensor_cost = dispatch_costs()
    assert 0.0 <= module_cost < 1e-3 and 0.0 <= tensor_cost < 1e-3


def test_sampler_alone_on_a_context_without_a_session():
    from policy_probes import ComponentContext, PolicyAutoBuilder

    policy = PolicyAutoBuilder.wrap(Net())
    context = ComponentContext()
    sampler = Sampler(context, schedule="every_k:2", budget=None)
    policy.attach("slow", attach_relu_activation_hooks(per_layer=False), context)
    x = torch.randn(5, 4)
    armed = []
    for _ in range(4):
        armed.append(policy.hooks_installed())
        policy(x)
        sampler.next_pass()
    assert armed == [True, False, True, False]
    assert sampler.totals() == {"relu/slow": (2, 10)}


REPORT_SECONDS = 0.03


class SlowReport(ReLUActivationState):
    """The ReLU tracker with a report that takes REPORT_SECONDS (its to_metrics)."""

    def summarize(self, component, state, settings):
        time.sleep(REPORT_SECONDS)
        return super().summarize(component, state, settings)


def test_a_report_costlier_than_the_budget_reports_every_few_epochs(tmp_path):
    """Epochs of 32 x 1 ms and a 30 ms report: under a 25 % budget one report would take
    more than half an epoch's allowance, so the probes report every m epochs; each report
    covers its window: the active rate equals one computed by hand over exactly the passes
    the probe observed in those epochs (read from whether its hook was installed). The
    run ends inside a window, with ``final=True``: that last epoch reports the rest."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    records, windows, seen = [], [], []
    with ProbeSession(net, run_dir=tmp_path, optimizer=opt, probe_budget=0.25, **NO_WANDB) as s:
        s.add_training_hook("slow", attach_relu_activation_hooks(per_layer=False))
        s.context.model_metrics["relu"].__class__ = SlowReport
        final = False
        for epoch in range(48):
            # end the run in an epoch that would not report on its own
            final = epoch >= 20 and not s.context.sampler.reports_this_epoch()
            s.set_phase("train")
            for _ in range(PASSES):
                if s.policy.hooks_installed():  # this pass is observed
                    with torch.no_grad():
                        seen.append(torch.relu(net.slow[0](x)))
                opt.zero_grad()
                net(x).backward()
                opt.step()
                time.sleep(0.001)
            record = s.epoch_end(step=epoch, final=final)
            records.append(record)
            if "probes/window_epochs" in record:
                windows.append((epoch, record, seen))
                seen = []
            if final:
                break
    assert final and windows[-1][0] == epoch and not seen  # nothing left unreported
    assert max(int(r["probes/window_epochs"]) for _, r, _ in windows) > 1
    last = -1
    for epoch, record, rows in windows:
        assert record["probes/window_epochs"] == epoch - last
        assert 1 <= record["probes/window_epochs"] <= MAX_REPORT_WINDOW
        last = epoch
        if not rows:
            assert "probes/relu/slow/active_rate" not in record
            continue
        h = torch.cat(rows)
        assert record["probes/relu/slow/passes_observed"] == len(rows)
        assert record["probes/relu/slow/samples"] == h.shape[0]
        assert record["probes/relu/slow/active_rate"] == pytest.approx(
            (h > 0).double().mean(0).tolist()
        )
    # epochs between reports carry no probe keys at all
    quiet = [r for r in records if "probes/window_epochs" not in r]
    assert quiet and not any(k.startswith("probes/") for r in quiet for k in r)
    # once the report cost is known, the windows the sampler chose are within the budget
    # (the forced last one may be shorter than a window while paying a whole report)
    assert len(windows) >= 3  # the report cost was known when the sampler chose it
    assert windows[-2][1]["probes/overhead_fraction"] <= 0.25


DRAIN_SECONDS = 0.02


class SlowDrain(ReLUActivationState):
    """The ReLU tracker whose reduction of held rows takes DRAIN_SECONDS (its consume)."""

    def consume(self, batch):
        time.sleep(DRAIN_SECONDS)
        super().consume(batch)


def test_a_drain_inside_a_hook_is_counted_once(tmp_path):
    """A full row buffer drains inside the probe's hook: the hook's timing counts that
    drain, so the tracker's own drain time must not count it again (the overhead would
    then be twice the real one and the probe sampled down for nothing). The metric still
    rests on every observed row: its active rate equals a plain recomputation."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # the weights stay, for the check below
    x = torch.randn(16, 4)
    with ProbeSession(net, run_dir=tmp_path, optimizer=opt, probe_budget=None, **NO_WANDB) as s:
        s.add_training_hook("slow", attach_relu_activation_hooks(per_layer=False))
        (tracker,) = [t for t in s.context.model_metrics.values() if t.probe == "relu"]
        tracker.__class__ = SlowDrain
        tracker.buffer_rows = 16  # one pass fills the buffer: each next push drains first
        s.set_phase("train")
        for _ in range(4):
            opt.zero_grad()
            net(x).backward()
            opt.step()
        assert tracker.seconds == 0.0  # the three in-hook drains are the hook's cost
        record = s.epoch_end(step=0)
    # three drains in the hooks, one at the report (counted there): at least 4 x 20 ms,
    # and well under the 7 x 20 ms that counting the in-hook drains twice would give
    assert 4 * DRAIN_SECONDS <= record["probes/overhead_seconds"] < 6 * DRAIN_SECONDS
    active = (net.slow(x) > 0).double().mean(0)  # the same rows in every pass
    assert record["probes/relu/slow/samples"] == 64
    assert record["probes/relu/slow/active_rate"] == pytest.approx(active.tolist())


SINK_SECONDS = 0.05


def test_the_epoch_end_beyond_the_collection_counts_without_lifecycle_hooks(tmp_path):
    """A session has no lifecycle hook by default (SB3's callback, loops of your own): its
    epoch end beyond collecting the trackers (the record written to the sinks, here a sink
    taking SINK_SECONDS per record) is the probes' reporting, counted in the next epoch's
    overhead."""

    def cheap_probe_and_slow_sink(session: ProbeSession) -> None:
        assert not session.hooks.hooks
        session.add_training_hook("cheap", attach_relu_activation_hooks(per_layer=False))
        emit = session.sinks.emit

        def slow_emit(*args, **kwargs):
            time.sleep(SINK_SECONDS)
            return emit(*args, **kwargs)

        session.sinks.emit = slow_emit

    records = run(tmp_path, None, 2, attach=cheap_probe_and_slow_sink, passes=4, step=0.0)
    assert records[1]["probes/overhead_seconds"] >= SINK_SECONDS
    assert records[1]["probes/relu/cheap/passes_observed"] == 4
