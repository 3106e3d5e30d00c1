"""Which training passes the probes observe, and what observing costs (docs/sampling.md).

A :class:`Schedule` says which passes a probe observes; a :class:`Sampler`
(``context.sampler``) applies it: at each pass end (the optimizer's step post-hook or
:meth:`Sampler.next_pass`) it arms the hooks of the probes that observe the next pass and
removes the others. The choice depends only on pass counters and stored settings.

Cost is host time (``time.perf_counter``, plus :func:`dispatch_costs`), measured without
host synchronisation; it steers only the budget's one-time calibration
(:meth:`Sampler._calibrate`).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from policy_probes.lifecycle.rng import preserved_rng

log = logging.getLogger("policy_probes")

#: default fraction of wall time the probes may take (ProbeSession, ProbeCallback, TrainTool)
DEFAULT_BUDGET = 0.05
#: a budgeted probe observes passes 0, k, 2k, ... of every epoch, with this k unless the
#: calibration chose a larger one (one per epoch on CleanRL's 4 x 4 minibatches)
DEFAULT_STRIDE = 16
#: the epoch (from 0) at whose end the strides are chosen once; epochs 0 and 1 are a
#: warm-up (epoch 0's end, with its first-time costs, is counted in epoch 1's)
CALIBRATION_EPOCH = 2
#: the calibration aims at this share of the budget: some costs no timer sees
AIM = 0.5


@dataclass(frozen=True)
class Schedule:
    """Which passes a probe observes (build one with the functions of this module)."""

    kind: Literal["every", "every_k", "per_epoch", "probe_batch", "budget"]
    #: every_k: observe every k-th pass
    k: int = 1
    #: per_epoch: passes per epoch
    n: int = 0
    #: probe_batch: rows of the dedicated pass
    rows: int = 0

    def __str__(self) -> str:
        arg = {"every_k": self.k, "per_epoch": self.n, "probe_batch": self.rows}.get(self.kind)
        return self.kind if arg is None else f"{self.kind}:{arg}"


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def every() -> Schedule:
    """Observe every training pass (exact; today's behaviour)."""
    return Schedule("every")


def every_k(k: int) -> Schedule:
    """Observe every ``k``-th training pass (pass 0, k, 2k, ... of the run)."""
    return Schedule("every_k", k=_positive_int(k, "every_k(k): k"))


def per_epoch(n: int) -> Schedule:
    """Observe ``n`` passes per epoch, spread evenly over it."""
    return Schedule("per_epoch", n=_positive_int(n, "per_epoch(n): n"))


def probe_batch(rows: int) -> Schedule:
    """Observe one dedicated forward and backward on ``rows`` rows at the epoch's end."""
    return Schedule("probe_batch", rows=_positive_int(rows, "probe_batch(rows): rows"))


def budgeted() -> Schedule:
    """Observe passes 0, k, 2k, ... of every epoch (k: :data:`DEFAULT_STRIDE` or larger)."""
    return Schedule("budget")


_SPEC = re.compile(r"^(?:(every|budget)|(every_k|per_epoch|probe_batch):(-?\d+))$")


def as_schedule(value: Schedule | str | None) -> Schedule | None:
    """A :class:`Schedule` from a schedule, ``None``, or a string: ``"every"``,
    ``"budget"``, ``"every_k:4"``, ``"per_epoch:2"``, ``"probe_batch:256"``."""
    if value is None or isinstance(value, Schedule):
        return value
    match = _SPEC.match(value.strip()) if isinstance(value, str) else None
    if match:
        plain, kind, arg = match.groups()
        if plain is not None:
            return every() if plain == "every" else budgeted()
        build = {"every_k": every_k, "per_epoch": per_epoch, "probe_batch": probe_batch}[kind]
        return build(int(arg))
    raise ValueError(
        f"schedule must be a Schedule (every(), every_k(k), per_epoch(n), probe_batch(rows), "
        f"budgeted()) or one of 'every', 'budget', 'every_k:<k>', 'per_epoch:<n>', "
        f"'probe_batch:<rows>', got {value!r}"
    )


def check_budget(budget: float | None) -> float | None:
    """``None`` (no budget) or a fraction strictly between 0 and 1."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < 1:
        raise ValueError(
            f"probe_budget is a fraction of wall time strictly between 0 and 1 (e.g. 0.05), "
            f"or None to observe every pass; got {budget!r}"
        )
    return float(budget)


def _shares(passes_seconds: float, parts: dict[str, float], wall: float) -> str:
    """The calibration warning's breakdown: each part's share of the epoch, largest first."""
    named = {
        "observed passes": passes_seconds,
        "report": parts["report"],
        "records and sinks": parts["records"],
        "arming": parts["arming"],
        "bookkeeping": parts["sampler"],
    }
    order = sorted(named.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {100 * seconds / max(wall, 1e-9):.1f} %" for name, seconds in order)


@functools.cache
def dispatch_costs() -> tuple[float, float]:
    """Seconds torch spends dispatching one forward hook on a module call, and one tensor
    hook, measured once per process against the same work without it (fastest of 3 rounds)."""
    module = nn.Identity()
    x = torch.ones(4, 4)
    w = torch.ones(4, 4, requires_grad=True)

    def noop(*_args: Any) -> None:
        return None

    def per_call(fn: Callable[[], None], n: int = 30) -> float:
        rounds = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            rounds.append((time.perf_counter() - t0) / n)
        return min(rounds)  # the least disturbed round

    bare = per_call(lambda: module(x))
    handle = module.register_forward_hook(noop)
    try:
        hooked = per_call(lambda: module(x))
    finally:
        handle.remove()

    def backward(hook: bool) -> None:
        y = w * 2.0
        if hook:
            y.register_hook(noop)
        torch.autograd.grad(y.sum(), w)

    with torch.enable_grad():  # the loop may report under no_grad
        plain = per_call(lambda: backward(False), 15)
        tapped = per_call(lambda: backward(True), 15)
    return max(hooked - bare, 0.0), max(tapped - plain, 0.0)


def tensor_rows(t: torch.Tensor, channels_first: bool = False) -> int:
    """Rows a probe reads from ``t`` (shape metadata only, no tensor work): the samples of
    a channels-first output, else every position but the last axis (units)."""
    if t.dim() < 2:
        return 1 if t.dim() == 0 else int(t.shape[0])
    if channels_first:
        return int(t.shape[0])
    return t.numel() // max(int(t.shape[-1]), 1)


@dataclass
class _HookCount:
    probe: str
    component: str
    #: passes and rows observed in the epoch under way (every epoch reports)
    passes: int = 0
    rows: int = 0
    module_calls: int = 0
    tensor_calls: int = 0
    seen_calls: int = 0
    #: passes and rows over the run (never reset)
    total_passes: int = 0
    total_rows: int = 0


class Sampler:
    """Applies schedules to the probe handles of one context and keeps the overhead budget.

    Args:
        context: the probes' :class:`~policy_probes.context.ComponentContext` (its
            ``sampler`` becomes this one).
        schedule: the default for probes built without ``schedule=`` (``None``:
            :func:`budgeted` under a budget, else :func:`every`).
        budget: the fraction of wall time the probes may take (``None``: every pass).
    """

    def __init__(
        self,
        context: Any,
        *,
        schedule: Schedule | str | None = None,
        budget: float | None = DEFAULT_BUDGET,
    ) -> None:
        self.context = context
        self.budget = check_budget(budget)
        #: the schedule of probes built without ``schedule=``
        self.default = as_schedule(schedule) or (budgeted() if self.budget is not None else every())
        #: training passes ended over the run / in the current epoch; epochs ended
        self.passes = self.epoch_passes = self.epochs = 0
        self.last_epoch_passes: int | None = None
        #: inside the dedicated probe-batch pass (only probe_batch schedules observe it)
        self.in_probe_batch = False
        #: a model context (``loss``, ``num_samples``, ``rows``) or a function that builds one
        self.probe_batch_source: Any = None
        self.generator = torch.Generator().manual_seed(0)  # the probe batch's rows
        #: probe -> k the calibration chose (the other budgeted probes: DEFAULT_STRIDE)
        self.observe_every: dict[str, int] = {}
        #: probe -> seconds per observed pass, as measured in the calibration epoch
        self.cost_per_pass: dict[str, float] = {}
        self.calibrated_epoch: int | None = None  # None: not yet, or no budget
        #: called with the choice once it is made (the session records it in config.json)
        self.on_choice: Callable[[dict[str, Any]], None] | None = None
        self.handles: dict[int, Any] = {}
        self.counts: dict[int, _HookCount] = {}
        self.own_seconds = 0.0
        #: installing and removing the probes' torch hooks (PolicyAutoBuilder._sync_handles)
        self.sync_seconds = 0.0
        #: StatsReporter.collect over the run (the session leaves it out of :meth:`charge`)
        self.collect_seconds = 0.0
        self._charged = 0.0  # the previous epoch end beyond the collection (:meth:`charge`)
        self.pinned: set[str] = set()  # components whose probes feed remedies (:meth:`pin`)
        self._warned = False
        self._restored: dict[str, list[int]] = {}  # checkpoint counts of unregistered probes
        #: the registered probes' distinct rules and their answers for this pass (next_pass)
        self._rules: list[tuple[str, int]] | None = None
        self._answers: tuple[bool, ...] | None = None
        self.epoch_start = time.perf_counter()
        context.sampler = self

    def schedule_of(self, hook: Any) -> Schedule:
        s = getattr(hook, "schedule", None) or self.default
        if s.kind == "probe_batch" and self.probe_batch_source is None:
            s = budgeted() if self.budget is not None else every()
        if s.kind == "budget" and self.budget is None:
            return every()
        return s

    def pin(self, component: str) -> None:
        """Keep :data:`DEFAULT_STRIDE` for the budgeted probes on ``component`` (a remedy
        acts on what they report, which must depend on the seed only, not measured time)."""
        self.pinned.add(component)
        self._rules = self._answers = None
        self.context.resync()

    def observes(self, handle: Any) -> bool:
        """Whether the probe of ``handle`` observes the pass under way (host-side only)."""
        hook = handle.hook
        key = id(handle)
        if key not in self.handles:
            if not getattr(hook, "sampled", False):
                return not self.in_probe_batch  # plain-function hooks keep every pass
            self.handles[key] = handle
            count = self.counts[key] = _HookCount(hook.probe, hook.component, seen_calls=hook.calls)
            saved = self._restored.pop(f"{hook.probe}/{hook.component}", None)
            if saved is not None:  # from a checkpoint (load_state_dict)
                _restore_count(count, saved)
            self._rules = self._answers = None
        return self._rule_holds(self._rule(hook))

    def _rule(self, hook: Any) -> tuple[str, int]:
        """What decides whether ``hook`` observes a pass: (kind, k or n)."""
        s = self.schedule_of(hook)
        if s.kind == "budget":
            if hook.component in self.pinned:
                return ("budget", DEFAULT_STRIDE)
            return ("budget", self.observe_every.get(hook.probe, DEFAULT_STRIDE))
        return (s.kind, s.k if s.kind == "every_k" else s.n)

    def _rule_holds(self, rule: tuple[str, int]) -> bool:
        kind, arg = rule
        if self.in_probe_batch or kind == "probe_batch":
            return self.in_probe_batch and kind == "probe_batch"
        if kind == "every":
            return True
        if kind == "every_k":
            return self.passes % arg == 0
        if kind == "budget":  # passes 0, k, 2k, ... of the epoch: never an epoch without one
            return self.epoch_passes % arg == 0
        stride = max((self.last_epoch_passes or 0) // arg, 1)  # per_epoch
        i = self.epoch_passes
        return i % stride == 0 and i // stride < arg

    def probe_batch_rows(self) -> int | None:
        """Rows of this epoch's probe batch (the most any probe asks); None: none waits."""
        rows = [
            s.rows
            for h in self.handles.values()
            if (s := getattr(h.hook, "schedule", None) or self.default).kind == "probe_batch"
        ]
        if not rows and self.default.kind == "probe_batch":
            rows = [self.default.rows]
        return max(rows) if rows else None

    def next_pass(self) -> None:
        """End the pass under way: count what it observed, arm the probes of the next."""
        t0 = time.perf_counter()
        if self._answers is None or any(self._answers):  # else no probe observed this pass
            self._account()
        self.passes += 1
        self.epoch_passes += 1
        # re-arm only when some rule's answer changed (most passes change nothing)
        if self._rules is None:
            self._rules = sorted({self._rule(h.hook) for h in self.handles.values()})
        answers = tuple(self._rule_holds(rule) for rule in self._rules)
        if answers != self._answers:
            self._answers = answers
            sync_start = time.perf_counter()
            self.context.resync()
            t0 += time.perf_counter() - sync_start  # counted in sync_seconds
        self.own_seconds += time.perf_counter() - t0

    def _account(self) -> None:
        for key, handle in self.handles.items():
            count, hook = self.counts[key], handle.hook
            if hook.calls == count.seen_calls:
                continue
            count.seen_calls = hook.calls
            if not handle.armed:
                continue
            count.passes += 1
            # each module hook fires about once per pass; a backward probe's module
            # hooks each register about one tensor hook (shared ones counted for each)
            count.module_calls += len(handle.handles)
            if hook.backward:
                count.tensor_calls += len(handle.handles)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """End a pass after every ``optimizer.step()``; returns the removable handle."""

        @torch.compiler.disable  # in a compiled update step: runs at a graph break
        def ended(*_args: Any) -> None:
            if self.context.phase != "hook":  # lifecycle replays are not training passes
                self.next_pass()

        return optimizer.register_step_post_hook(ended)

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of the session's epoch end beyond the collection (record
        conversion, sinks) in the next epoch's overhead; nothing without a probe."""
        if self.handles:
            self._charged += max(seconds, 0.0)

    def before_collect(self) -> None:
        """Run this epoch's probe batch, if a probe waits for one (before the report)."""
        if self.probe_batch_source is not None and self.probe_batch_rows() is not None:
            source = self.probe_batch_source
            if not hasattr(source, "rows"):  # a factory: build the model context now
                source = self.probe_batch_source = source()
            run_probe_batch(self, source, self.generator)

    def end_epoch(self, trackers: list[Any], *, report_seconds: float = 0.0) -> dict[str, float]:
        """Close the epoch's accounting (``report_seconds``: the report's): the overhead, passes
        and rows observed, ``observe_every``; calibrates once (:meth:`_calibrate`)."""
        if not self.handles:  # no probe attached: nothing to report
            self.epoch_start = time.perf_counter()
            return {}
        t0 = time.perf_counter()
        module_cost, tensor_cost = dispatch_costs()  # calibrated once: the first epoch pays
        self._account()
        wall = t0 - self.epoch_start
        cost: dict[str, float] = {}
        observed: dict[str, int] = {}
        out: dict[str, float] = {}
        for key, handle in self.handles.items():
            hook, count = handle.hook, self.counts[key]
            count.rows += hook.rows
            count.total_rows += hook.rows
            count.total_passes += count.passes
            hook.rows = 0
            seconds = hook.seconds + count.module_calls * module_cost
            seconds += count.tensor_calls * tensor_cost
            hook.seconds = 0.0
            cost[count.probe] = cost.get(count.probe, 0.0) + seconds
            observed[count.probe] = max(observed.get(count.probe, 0), count.passes)
            count.module_calls = count.tensor_calls = 0
            # beside a built-in probe's metrics (none in an epoch it observed no pass of)
            if count.passes and getattr(hook, "tracker", None) is not None:
                prefix = f"probes/{count.probe}/{count.component}"
                out[f"{prefix}/passes_observed"] = float(count.passes)
                out[f"{prefix}/rows_observed"] = float(count.rows)
            count.passes = count.rows = 0
        for tracker in trackers:  # drains: the work of the rows the probes observed
            probe = getattr(tracker, "probe", None)
            seconds = getattr(tracker, "seconds", 0.0)
            if probe is not None and seconds:
                cost[probe] = cost.get(probe, 0.0) + seconds
                tracker.seconds = 0.0
        parts = self.overhead_parts(cost, report_seconds)
        overhead = sum(parts.values())
        self._charged = 0.0
        if self.budget is not None and not self.passes and not self._warned:
            self._warned = True
            log.warning(
                "probe_budget: no training pass has ended yet, so every pass is observed; "
                "pass optimizer=... to the session or call session.next_pass() after each "
                "optimizer step"
            )
        out["probes/overhead_fraction"] = overhead / wall if wall > 0 else 0.0
        out["probes/overhead_seconds"] = overhead
        for part, seconds in parts.items():
            out[f"probes/overhead_seconds/{part}"] = seconds
        if (
            self.budget is not None
            and self.calibrated_epoch is None
            and self.epochs >= CALIBRATION_EPOCH
            and self.epoch_passes
        ):
            self._calibrate(cost, observed, wall, parts)
        for probe, k in self.strides().items():
            out[f"probes/{probe}/observe_every"] = float(k)
        self.last_epoch_passes, self.epoch_passes = self.epoch_passes, 0
        self.epochs += 1
        self.own_seconds = time.perf_counter() - t0
        self.sync_seconds = 0.0
        self.epoch_start = time.perf_counter()
        self._rules = self._answers = None  # per_epoch schedules start over
        self.context.resync()
        return out

    def overhead_parts(self, cost: dict[str, float], report_seconds: float) -> dict[str, float]:
        """The epoch's ``probes/overhead_seconds`` in parts: ``passes.<probe>`` (hooks, dispatch,
        drains), ``report``, ``arming`` (hook installs), ``sampler`` (bookkeeping), ``records``."""
        parts = {f"passes.{probe}": seconds for probe, seconds in sorted(cost.items())}
        parts["report"] = report_seconds
        parts["arming"] = self.sync_seconds
        parts["sampler"] = self.own_seconds
        parts["records"] = self._charged
        return parts

    def budgeted_probes(self) -> set[str]:
        """The probes whose schedule is the budget's (the default under a budget)."""
        return {
            c.probe
            for key, c in self.counts.items()
            if self.schedule_of(self.handles[key].hook).kind == "budget"
        }

    def strides(self) -> dict[str, int]:
        """``probe -> k`` of every budgeted probe (passes 0, k, 2k, ... of each epoch)."""
        return {
            p: self.observe_every.get(p, DEFAULT_STRIDE) for p in sorted(self.budgeted_probes())
        }

    def _calibrate(
        self, cost: dict[str, float], observed: dict[str, int], wall: float, parts: dict[str, float]
    ) -> None:
        """Choose the budgeted probes' strides once: double the stride of the probe with the
        largest projected cost until within :data:`AIM` of the budget (or one pass per epoch)."""
        overhead = sum(parts.values())
        fixed = overhead - sum(cost.values())  # the parts besides the observed passes
        probes = self.budgeted_probes()
        passes = self.epoch_passes
        per_pass = {p: cost.get(p, 0.0) / observed[p] for p in probes if observed.get(p)}
        self.cost_per_pass = dict(per_pass)
        # what the probes may cost: budget b of the wall time = b / (1 - b) of the rest
        allowed = AIM * self.budget / (1 - self.budget) * max(wall - overhead, 0.0)
        allowed -= fixed + sum(cost.get(p, 0.0) for p in cost if p not in per_pass)
        ks = {p: self.observe_every.get(p, DEFAULT_STRIDE) for p in per_pass}

        def projected(p: str) -> float:  # passes 0, k, 2k, ... of an epoch of `passes`
            return per_pass[p] * math.ceil(passes / ks[p])

        while ks and sum(projected(p) for p in ks) > allowed:
            open_ = [p for p in ks if ks[p] < passes]
            if not open_:
                passes_seconds = sum(projected(p) for p in ks)
                log.warning(
                    "probe_budget=%g: the probes' report and one observed training pass "
                    "per epoch took %.1f %% of epoch %d's time (%s); every epoch is still "
                    "observed. For less, attach fewer probes or layers (per_layer=False), "
                    "or set probe_schedule='every_k:<k>' (epochs without an observed pass "
                    "then carry no probe metrics)",
                    self.budget,
                    100 * (passes_seconds + fixed) / max(wall, 1e-9),
                    self.epochs + 1,
                    _shares(passes_seconds, parts, wall),
                )
                break
            worst = max(open_, key=projected)
            ks[worst] *= 2
        self.observe_every.update(ks)
        self.calibrated_epoch = self.epochs
        if self.on_choice is not None:
            self.on_choice(self.choice())

    def choice(self) -> dict[str, Any]:
        """What the budget's calibration chose (plain values, for ``config.json``)."""
        return {
            "budget": self.budget,
            "calibrated_epoch": self.calibrated_epoch,
            "observe_every": self.strides(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Pass counters, strides and this epoch's counts (a resume observes the same passes)."""
        counts = {
            name: [c.passes, c.rows + held, c.total_passes, c.total_rows + held]
            for name, c, held in self._held_counts()
        }
        return {
            **{name: getattr(self, name) for name in _COUNTERS},
            "observe_every": dict(self.observe_every),
            "cost_per_pass": dict(self.cost_per_pass),
            "counts": counts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (counts apply as the probes register)."""
        for name in _COUNTERS:
            setattr(self, name, None if state[name] is None else int(state[name]))
        self.observe_every = {k: int(v) for k, v in state["observe_every"].items()}
        self.cost_per_pass = {k: float(v) for k, v in state["cost_per_pass"].items()}
        self._restored = {k: [int(x) for x in v] for k, v in state["counts"].items()}
        for count in self.counts.values():  # probes registered already
            saved = self._restored.pop(f"{count.probe}/{count.component}", None)
            if saved is not None:
                _restore_count(count, saved)
        self._rules = self._answers = None
        self.context.resync()

    def totals(self) -> dict[str, tuple[int, int]]:
        """``"<probe>/<component>" -> (passes, rows)`` observed over the run so far."""
        return {
            name: (c.total_passes + c.passes, c.total_rows + held)
            for name, c, held in self._held_counts()
        }

    def _held_counts(self) -> list[tuple[str, _HookCount, int]]:
        """``("<probe>/<component>", counts, rows its hook holds)``, the pass under way counted."""
        self._account()
        return [
            (f"{c.probe}/{c.component}", c, self.handles[key].hook.rows)
            for key, c in self.counts.items()
        ]


#: the Sampler's integer state (last_epoch_passes and calibrated_epoch may be None)
_COUNTERS = ("passes", "epochs", "epoch_passes", "last_epoch_passes", "calibrated_epoch")


def _restore_count(count: _HookCount, saved: list[int]) -> None:
    """Counts from :meth:`Sampler.state_dict` (the epoch's passes and rows, the run's)."""
    count.passes, count.rows, count.total_passes, count.total_rows = saved


def standard_error(rate: float, n: float) -> float:
    """Standard error of a proportion ``rate`` over ``n`` rows, sqrt(p (1 - p) / n), rows
    taken as independent (rows of one pass are correlated, so read it as a lower bound)."""
    return 0.0 if n <= 0 else math.sqrt(max(rate * (1.0 - rate), 0.0) / n)


def run_probe_batch(sampler: Sampler, model_ctx: Any, generator: torch.Generator) -> int:
    """Run this epoch's probe batch: rows of ``model_ctx``'s data drawn with ``generator``,
    one forward and ``torch.autograd.grad`` through its ``loss`` with only the probe-batch
    probes armed; no ``.grad`` written, global RNGs and buffers restored. Returns the rows
    used (0: no probe waits for one)."""
    rows = sampler.probe_batch_rows()
    if rows is None:
        return 0
    available = model_ctx.num_samples()
    if rows > available:
        raise ValueError(
            f"probe_batch({rows}) asks for more rows than this epoch's data holds "
            f"({available}); choose probe_batch(rows) with rows <= {available}"
        )
    start, synced = time.perf_counter(), sampler.sync_seconds
    context = sampler.context
    idx = torch.randperm(available, generator=generator)[:rows].sort().values
    model = model_ctx.model
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    phase, infer = context.phase, context.infer_phase
    sampler.in_probe_batch = True
    try:
        with preserved_rng(), torch.enable_grad():
            context.infer_phase = False
            context.phase = "train"
            context.resync()
            loss = model_ctx.loss(model_ctx.rows(idx))
            if params and loss.requires_grad:
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        sampler._account()
        sampler.in_probe_batch = False
        sampler._answers = None
        context.phase, context.infer_phase = phase, infer
        context.resync()
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        # the hook (un)installs are in sync_seconds already
        sampler.own_seconds += time.perf_counter() - start - (sampler.sync_seconds - synced)
    return rows
