"""MetricSink: where per-epoch metrics go, and SinkGroup: the fan-out that isolates faults.

Probes, trackers and lifecycle hooks produce one flat ``dict[str, value]`` per emit; they
never know which sinks are active. A :class:`SinkGroup` hands every emit to each sink and
switches off a sink that raises (reported once, with the reason) so that a broken output
can never stop training or keep the other outputs from receiving every epoch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger("policy_probes.sinks")

#: fields every record carries beside the metrics
RESERVED_KEYS = ("epoch", "agent_step", "hook_point")


class MetricSink(ABC):
    """One output for metrics (a file, a dashboard, the console).

    Lifecycle: ``set_run_context(...)`` whenever the run's context changes (at least the
    ``agent_step`` before each emit), ``emit(...)`` once per hook point and epoch,
    ``flush()`` at epoch end and on interruption, ``close()`` once at the end.
    """

    #: short name used in fault reports and configuration
    name: str = "sink"

    def __init__(self) -> None:
        self.run_context: dict[str, Any] = {}

    def set_run_context(self, **kwargs: Any) -> None:
        """Update the run context: ``agent_step`` (env steps so far), ``run_dir``,
        ``config`` (resolved config dict), ``rank``, ... Later calls update earlier ones."""
        self.run_context.update(kwargs)

    @abstractmethod
    def emit(self, metrics: Mapping[str, Any], epoch: int, hook_point: str) -> None:
        """Record one flat dict of metrics for ``epoch`` at ``hook_point``."""

    def flush(self) -> None:  # noqa: B027 - optional for sinks without buffers
        """Push buffered data to durable storage."""

    def close(self) -> None:
        """Flush and release resources. Called once; emits after close are errors."""
        self.flush()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


#: default seconds between the fsyncs of an append-only file at epoch ends (an fsync took
#: 0.3 to 20 ms here: every 2 s it was ~2 % of a RecurrentPPO + ProbeCallback run)
FSYNC_SECONDS = 30.0


class AppendFileSink(MetricSink):
    """A sink that appends to one file, ``self.path``, held open between emits.

    Every emit is flushed to the operating system at once (a killed process loses
    nothing written); :meth:`flush` reaches the disk (``fsync``). At epoch ends
    (:meth:`written`) the file is fsynced at most once per :attr:`fsync_seconds`: an
    fsync took 0.3 to 20 ms on the benchmark machine, a large share of a short epoch,
    and only a machine crash can lose what is flushed but not fsynced (at most
    the last ``fsync_seconds``). Checkpoints flush first
    (:meth:`policy_probes.session.ProbeSession.state_dict`), so a checkpoint never covers
    records that are not on disk.
    """

    #: ``newline`` argument of ``open`` ("" for the csv module)
    newline: str | None = None

    def __init__(self, path: Path, fsync_seconds: float = FSYNC_SECONDS) -> None:
        super().__init__()
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        #: at most one fsync per this many seconds at epoch ends (0: at every epoch end)
        self.fsync_seconds = fsync_seconds

    def _open_append(self) -> None:
        """(Re)open ``self.path`` for appending, e.g. after a rewrite replaced the file."""
        self._file = open(self.path, "a", encoding="utf-8", newline=self.newline)  # noqa: SIM115
        self._synced_at = -math.inf

    def written(self, hook_point: str) -> None:
        """After a record was written: hand it to the operating system, and fsync at an
        epoch end (``POST_EPOCH``) when the last fsync is ``fsync_seconds`` old."""
        if hook_point == "POST_EPOCH" and (
            time.monotonic() - self._synced_at >= self.fsync_seconds
        ):
            self.flush()  # hands it over and fsyncs
        else:
            self._file.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._synced_at = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


class SinkGroup(MetricSink):
    """Fan-out to several sinks with fault isolation.

    A sink whose ``emit``, ``flush``, ``set_run_context`` or ``close`` raises is logged
    once (error level, with the exception and traceback), recorded in :attr:`failures` and
    removed from the group; the other sinks go on. The group itself never raises from these
    methods.
    """

    name = "group"

    def __init__(self, sinks: Iterable[MetricSink] = ()) -> None:
        super().__init__()
        self.sinks: list[MetricSink] = list(sinks)
        #: sink name -> reason, for every sink switched off after a fault
        self.failures: dict[str, str] = {}
        #: sink name -> (epoch, hook point) of the first record it did not take (None:
        #: switched off outside emit, e.g. at flush or close)
        self.failed_at: dict[str, tuple[int, str] | None] = {}
        self._record: tuple[int, str] | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ membership
    def add(self, sink: MetricSink) -> None:
        with self._lock:
            self.sinks.append(sink)

    def __iter__(self):
        return iter(list(self.sinks))

    def __len__(self) -> int:
        return len(self.sinks)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sinks]

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            for sink in list(self.sinks):
                try:
                    getattr(sink, method)(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - isolation is the point
                    self._switch_off(sink, method, exc)

    def _switch_off(self, sink: MetricSink, method: str, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        label = sink.name
        if label in self.failures:  # two sinks of the same kind
            label = f"{label}#{id(sink):x}"
        self.failures[label] = f"{method}() raised {reason}"
        self.failed_at[label] = self._record if method == "emit" else None
        logger.error(
            "metric sink %r failed in %s() and is switched off; the other sinks and training "
            "go on. Reason: %s",
            sink.name,
            method,
            reason,
            exc_info=exc,
        )
        if sink in self.sinks:
            self.sinks.remove(sink)
        # best effort: let the sink release what it holds, ignore any second fault
        if method != "close":
            with contextlib.suppress(Exception):
                sink.close()

    # ------------------------------------------------------------------ MetricSink API
    def set_run_context(self, **kwargs: Any) -> None:
        super().set_run_context(**kwargs)
        self._call("set_run_context", **kwargs)

    def emit(self, metrics: Mapping[str, Any], epoch: int, hook_point: str) -> None:
        self._record = (epoch, hook_point)
        self._call("emit", metrics, epoch, hook_point)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._call("close")
            self.restore_signal_handlers()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> SinkGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ signals
    def install_signal_flush(
        self, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM)
    ) -> Callable[[], None]:
        """Flush every sink when one of ``signals`` arrives, then hand the signal to the
        handler that was installed before (so Ctrl-C still raises ``KeyboardInterrupt`` and
        SIGTERM still terminates unless the caller installed its own handler).

        Only possible from the main thread; elsewhere this logs and does nothing. Returns a
        function that restores the previous handlers (also done by :meth:`close`). A trainer
        with its own run control (finish the minibatch, checkpoint, exit 130/143) should
        call :meth:`flush` from its handler instead of using this.
        """
        if threading.current_thread() is not threading.main_thread():
            logger.warning("install_signal_flush() called outside the main thread; ignored")
            return lambda: None
        for sig in signals:
            self._previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self.restore_signal_handlers

    def restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        logger.warning("signal %s: flushing metric sinks", signal.Signals(signum).name)
        self.flush()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            self.restore_signal_handlers()
            signal.raise_signal(signum)


# ---------------------------------------------------------------------- value helpers
def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into ``a/b/c`` keys (lifecycle hooks may return nested dicts)."""
    if not prefix and set(map(type, metrics)) <= {str} and not _any_nested(metrics.values()):
        return dict(metrics)  # already flat: every emit of the built-in loops
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        full = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, full))
        else:
            out[full] = value
    return out


def plain_metrics(
    metrics: Mapping[str, Any], skip: Iterable[str] = RESERVED_KEYS
) -> Iterator[tuple[str, Any]]:
    """``(a/b/c key, plain value)`` of every metric (:func:`flatten_metrics`,
    :func:`to_plain`) whose key is not in ``skip`` (the record's own fields by default)."""
    skip = frozenset(skip)
    for key, value in flatten_metrics(metrics).items():
        if key not in skip:
            yield key, value if type(value) in _PLAIN_SCALARS else to_plain(value)


#: the exact types for which a list is copied as it is; a list holding any other type
#: (numpy scalars, tensors, nested lists) is converted element by element
_PLAIN_SCALARS = frozenset({float, int, bool, str, type(None)})


def _any_nested(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a mapping to flatten, asked once per distinct type: an
    emit holds hundreds of values of a handful of types."""
    return any(
        kind is dict
        or (kind not in _PLAIN_SCALARS and kind is not list and issubclass(kind, Mapping))
        for kind in set(map(type, values))
    )


def to_plain(value: Any) -> Any:
    """A JSON-safe copy of ``value``: Python floats, ints, bools, strings, lists, dicts
    with string keys, or None.

    Tensors and arrays with more than one element become flat lists; mappings keep their
    structure; anything else that is not a number becomes its ``str`` (paths in a
    configuration; a sink must never crash on an odd value).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if _PLAIN_SCALARS.issuperset(map(type, value)):  # a per-unit vector: copy it
            return list(value)
        return [to_plain(v) for v in value]
    tolist = getattr(value, "tolist", None)  # torch.Tensor, numpy arrays and scalars
    if callable(tolist):
        detach = getattr(value, "detach", None)
        if callable(detach):
            value = detach().cpu()
            tolist = value.tolist
        plain = tolist()
        if isinstance(plain, list):
            return [to_plain(v) for v in _flatten_list(plain)]
        return plain
    return str(value)


def _flatten_list(values: list[Any]) -> Iterable[Any]:
    for v in values:
        if isinstance(v, list):
            yield from _flatten_list(v)
        else:
            yield v


def is_finite_number(value: Any) -> bool:
    """True for ints and finite floats (bools count as numbers)."""
    if isinstance(value, bool | int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def finite_values(values: Iterable[Any]) -> list[float]:
    """The finite numeric elements of a per-unit vector (None and NaN/inf left out). A
    list of finite floats is returned as it is (callers only read it)."""
    if type(values) is not list:
        values = list(values)
    try:  # the common case, every element a finite float: C-level passes only
        kinds = set(map(type, values))
        if kinds <= _FLOATS and all(map(math.isfinite, values)):
            return values if kinds <= {float} else list(map(float, values))
    except TypeError:
        pass
    return [float(v) for v in values if is_finite_number(v)]


_FLOATS = frozenset({float, int})


def vector_stats(values: list[Any]) -> tuple[float, float, float] | None:
    """Mean, min and max of the finite numeric elements of a per-unit vector (None when
    it has none). The mean is ``math.fsum``'s exact sum over the count (of the elements
    over the count where that sum leaves the float range).

    A finite ``fsum`` of the whole list means every element is a finite number (a NaN
    makes it NaN, an infinity infinite or a ValueError, anything else a TypeError), so
    the common case needs no separate pass to check or filter the elements."""
    try:
        total = math.fsum(values)
    except (TypeError, ValueError, OverflowError):
        total = math.nan
    if values and math.isfinite(total):
        return total / len(values), float(min(values)), float(max(values))
    finite = finite_values(values)
    if not finite:
        return None
    try:
        mean = math.fsum(finite) / len(finite)
    except OverflowError:  # the sum leaves the float range, the mean does not
        mean = math.fsum(v / len(finite) for v in finite)
    return mean, min(finite), max(finite)
