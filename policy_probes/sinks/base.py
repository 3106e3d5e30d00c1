"""MetricSink: where records go, and SinkGroup: the fan-out that isolates faults, so a
broken output never stops training or the other outputs. Sinks only write; the figures a
sink asks for are drawn by the session's analysis."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from policy_probes.records import Figures, Record
from policy_probes.sinks.config import FSYNC_SECONDS, SinkSetup

logger = logging.getLogger("policy_probes.sinks")


class MetricSink(ABC):
    """One output for records (a file, a dashboard, the console); registered with
    :func:`policy_probes.plugins.register`, it is switched on by ``sinks.<name>=true``.
    Calls: ``set_run_context`` when the run's context changes, ``emit`` per hook point and
    epoch, ``flush`` at epoch end and on interruption, ``final_figures`` before ``close``
    when asked for, ``close`` once at the end."""

    kind: ClassVar[str] = "sink"
    #: the name configuration selects it by (``sinks.<name>``) and fault reports use
    name: str = "sink"
    docs: ClassVar[str] = "docs/sinks.md"
    #: whether this sink may ask for the run's figures (:meth:`wants_figures`): the
    #: session keeps the series they draw only when a sink of its group may
    logs_figures: bool = False

    def __init__(self) -> None:
        self.run_context: dict[str, Any] = {}

    @classmethod
    def from_setup(cls, setup: SinkSetup) -> MetricSink | None:
        """The sink of a run that switched it on (None: nothing to do); by default made
        without arguments (:meth:`set_run_context` gives it the run directory)."""
        return cls()

    def set_run_context(self, **kwargs: Any) -> None:
        """Update the run context: ``run_dir``, ``config``, ``ended`` (how the run ended) ..."""
        self.run_context.update(kwargs)

    @abstractmethod
    def emit(self, record: Record) -> None:
        """Write one record (plain already; never changed by a sink)."""

    def wants_figures(self, record: Record | None) -> bool:
        """Whether this sink logs the run's figures with ``record`` (``record.figures``) or,
        for None, at close (:meth:`final_figures`); drawing takes seconds: ask seldom."""
        return False

    def final_figures(self, figures: Figures) -> None:  # noqa: B027 - optional
        """The run's figures as it ends, when ``wants_figures(None)``."""

    def flush(self) -> None:  # noqa: B027 - optional for sinks without buffers
        """Push buffered data to durable storage."""

    def close(self) -> None:
        """Flush and release resources. Called once; emits after close are errors."""
        self.flush()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AppendFileSink(MetricSink):
    """A sink that appends to one file, ``self.path``, held open between emits. Every emit
    reaches the OS at once (a killed process loses nothing); :meth:`flush` fsyncs, at
    epoch ends at most once per ``fsync_seconds`` (an fsync can cost a large share of a
    short epoch; only a machine crash loses what is not fsynced). Checkpoints flush first."""

    #: ``newline`` argument of ``open`` ("" for the csv module)
    newline: str | None = None
    #: what one entry of the file is called in the warning about a truncated one
    entry: ClassVar[str] = "line"

    def __init__(self, path: Path, fsync_seconds: float = FSYNC_SECONDS) -> None:
        super().__init__()
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        #: at most one fsync per this many seconds at epoch ends (0: at every epoch end)
        self.fsync_seconds = fsync_seconds
        dropped = repair_truncated_tail(self.path)
        if dropped:
            logger.warning(
                "%s ended in a truncated %s (%d bytes, an interrupted write); it was removed",
                self.path,
                self.entry,
                dropped,
            )

    @classmethod
    def from_setup(cls, setup: SinkSetup) -> AppendFileSink:
        return cls(setup.run_dir, fsync_seconds=setup.sinks.fsync_seconds)

    def _open_append(self) -> None:
        """(Re)open ``self.path`` for appending, e.g. after a rewrite replaced the file."""
        self._file = open(self.path, "a", encoding="utf-8", newline=self.newline)  # noqa: SIM115
        self._synced_at = -math.inf

    def written(self, hook_point: str) -> None:
        """After a record: hand it to the OS, and fsync at an epoch end that is due."""
        if hook_point == "POST_EPOCH" and (
            time.monotonic() - self._synced_at >= self.fsync_seconds
        ):
            self.flush()
        else:
            self._file.flush()

    @contextlib.contextmanager
    def reopened(self) -> Iterator[None]:
        """Close the file for a rewrite inside the block; open it for appending after."""
        self.close()
        try:
            yield
        finally:
            self._open_append()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._synced_at = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


def repair_truncated_tail(path: Path, chunk: int = 1 << 16) -> int:
    """Cut an incomplete last line (no trailing newline) off ``path``, reading only the
    file's tail; returns the number of bytes removed (0: absent, empty or whole)."""
    try:
        f = open(path, "rb+")  # noqa: SIM115
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos, keep = size, 0
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            nl = f.read(pos - start).rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


class SinkGroup(MetricSink):
    """Fan-out to several sinks with fault isolation: a sink whose method raises is logged
    once (with the traceback), recorded in :attr:`failures` and removed; the others go on
    and the group itself never raises. The sinks that want the run's figures get them,
    drawn once by :attr:`draw_figures`."""

    name = "group"

    def __init__(self, sinks: Iterable[MetricSink] = ()) -> None:
        super().__init__()
        self.sinks: list[MetricSink] = list(sinks)
        #: sink name -> reason, for every sink switched off after a fault
        self.failures: dict[str, str] = {}
        #: sink name -> (epoch, hook point) of the first record it did not take (None:
        #: switched off outside emit, e.g. at flush or close)
        self.failed_at: dict[str, tuple[int, str] | None] = {}
        #: draws the run's figures when a sink asks (set by the session; None: no figures)
        self.draw_figures: Callable[[], Figures] | None = None
        self._record: tuple[int, str] | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}

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
                self._isolated(sink, method, *args, **kwargs)

    def _isolated(self, sink: MetricSink, method: str, *args: Any, **kwargs: Any) -> Any:
        """``sink.method(*args)``; None and the sink switched off when it raises."""
        try:
            return getattr(sink, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            self._switch_off(sink, method, exc)
            return None

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
        if method != "close":  # let it release what it holds; a second fault is ignored
            with contextlib.suppress(Exception):
                sink.close()

    def _figures_for(self, record: Record | None) -> tuple[list[MetricSink], Figures | None]:
        """The sinks that want the figures with ``record`` (None: at close), and the
        figures (None when none asks or the drawing failed)."""
        if self.draw_figures is None:
            return [], None
        asking = [s for s in list(self.sinks) if self._isolated(s, "wants_figures", record)]
        if not asking:
            return [], None
        try:
            return asking, self.draw_figures()
        except Exception as exc:  # noqa: BLE001 - figures must never cost a record
            logger.error("drawing the run's figures failed: %s", exc, exc_info=exc)
            return [], None

    def set_run_context(self, **kwargs: Any) -> None:
        super().set_run_context(**kwargs)
        self._call("set_run_context", **kwargs)

    def emit(self, record: Record) -> None:
        with self._lock:
            self._record = (record.epoch, record.hook_point)
            asking, figures = self._figures_for(record)
            drawn = record if figures is None else dataclasses.replace(record, figures=figures)
            for sink in list(self.sinks):
                self._isolated(sink, "emit", drawn if sink in asking else record)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            asking, figures = self._figures_for(None)
            for sink in asking if figures is not None else ():
                self._isolated(sink, "final_figures", figures)
            self._call("close")
            self.restore_signal_handlers()

    def __enter__(self) -> SinkGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install_signal_flush(
        self, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM)
    ) -> Callable[[], None]:
        """Flush every sink when one of ``signals`` arrives, then hand the signal to the
        previous handler (main thread only); returns the function that restores the
        previous handlers (:meth:`close` does too)."""
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
