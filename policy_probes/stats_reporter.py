"""StatsReporter: the single place where probe trackers become metrics."""

from __future__ import annotations

import logging
import time
from typing import Any

from policy_probes.context import ComponentContext
from policy_probes.probes.state import all_reduce_trackers
from policy_probes.processes import multi_process

log = logging.getLogger("policy_probes")


class StatsReporter:
    """Reads every tracker in ``context.model_metrics`` at the end of every epoch:
    :meth:`collect` all-reduces them across processes (under ``torch.distributed``, in one
    exchange), calls ``to_metrics()`` then ``reset()``, and returns one flat dict
    ``probes/<probe>/<component>/<metric>``, with ``probes/errors/<key> = 1.0`` per
    disabled probe."""

    def __init__(self, context: ComponentContext, *, all_reduce: bool = True) -> None:
        self.context = context
        self.all_reduce = all_reduce

    def collect(self) -> dict[str, Any]:
        sampler = getattr(self.context, "sampler", None)
        start = time.perf_counter()
        try:
            return self._collect(sampler)
        finally:
            if sampler is not None:
                sampler.collect_seconds += time.perf_counter() - start

    def _collect(self, sampler: Any) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if sampler is not None:  # the dedicated pass of probe_batch probes
            try:
                sampler.before_collect()
            except ValueError:
                raise  # a probe batch larger than the epoch's data: the configuration must change
            except Exception as exc:  # a probe must never take training down
                if self.context.strict:
                    raise
                self.context.probe_errors["probe_batch"] = f"{type(exc).__name__}: {exc}"
                log.error("the probe batch failed and is skipped: %s", exc)
        trackers = [
            t
            for t in self.context.model_metrics.values()
            if hasattr(t, "to_metrics") and hasattr(t, "reset")
        ]
        # the report's drains are a fixed cost of reporting (their work hardly shrinks
        # with fewer rows): charged to the report, not to the probes' observed passes
        drained_before = [getattr(t, "seconds", 0.0) for t in trackers]
        start = time.perf_counter()
        self._measure_reference(trackers)  # before the all-reduce, which carries its sums
        # single process: all_reduce would only drain the held rows, as to_metrics does
        if self.all_reduce and multi_process():
            self._all_reduce(trackers)
        for tracker in trackers:
            metrics.update(tracker.to_metrics())
            tracker.reset()
            self._take_errors(tracker)
        report_seconds = time.perf_counter() - start
        for tracker, seconds in zip(trackers, drained_before, strict=True):
            if hasattr(tracker, "seconds"):
                tracker.seconds = seconds
        if sampler is not None:  # the epoch's overhead and observed passes
            try:
                metrics.update(sampler.end_epoch(trackers, report_seconds=report_seconds))
            except Exception as exc:  # accounting must never take training down
                if self.context.strict:
                    raise
                log.error("probe sampler failed at the epoch's end: %s", exc)
        for key in self.context.probe_errors:
            metrics[f"probes/errors/{key}"] = 1.0
        return metrics

    def _measure_reference(self, trackers: list[Any]) -> None:
        """The trackers that score units on the run's reference states measure them, on
        one shared forward (docs/reference_states.md); a failure is reported once under
        ``probes/errors/<probe>/reference_states`` and training goes on."""
        states = getattr(self.context, "reference_states", None)
        if states is None:
            return
        try:
            for tracker in trackers:
                measure = getattr(tracker, "measure_reference", None)
                if measure is None:
                    continue
                try:
                    measure()
                except Exception as exc:  # a probe must never take training down
                    if self.context.strict:
                        raise
                    key = f"{tracker.probe}/reference_states"
                    if key not in self.context.probe_errors:
                        log.error("probe %s on the reference states failed: %s", key, exc)
                    self.context.probe_errors[key] = f"{type(exc).__name__}: {exc}"
        finally:
            states.release()

    def _all_reduce(self, trackers: list[Any]) -> None:
        """Combine the trackers across processes: those with ``reduced_tensors`` (every
        :class:`ProbeState`) in one exchange (:func:`all_reduce_trackers`), any other with
        its own ``all_reduce()``."""
        taken = {id(t) for t in trackers if hasattr(t, "reduced_tensors")}
        states: dict[str, Any] = {}
        for name, tracker in self.context.model_metrics.items():
            if id(tracker) in taken:  # each tracker once, under its first name
                taken.discard(id(tracker))
                states[name] = tracker
        all_reduce_trackers(states)
        for tracker in trackers:
            if not hasattr(tracker, "reduced_tensors") and hasattr(tracker, "all_reduce"):
                tracker.all_reduce()

    def _take_errors(self, tracker: Any) -> None:
        """Move reduction failures of ``tracker`` into the context (fatal when strict)."""
        errors = getattr(tracker, "errors", None)
        if not errors:
            return
        for component, message in errors.items():
            key = f"{tracker.probe}/{component}"
            if self.context.strict:
                raise RuntimeError(f"probe {key} failed: {message}")
            if key not in self.context.probe_errors:
                log.error("probe %s lost this window's data: %s", key, message)
            self.context.probe_errors[key] = message
        errors.clear()
