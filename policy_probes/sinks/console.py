"""ConsoleSink: the run's main figures in the terminal (rich).

On an interactive terminal a live view (latest value, trend arrow and sparkline of each
chosen metric; pass the trainer's console to share it with a progress bar); at each
SNAPSHOT and at close a table of the chosen metrics and the SNAPSHOT's shallow scalar keys;
at close the run's findings."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

from policy_probes.plugins import register
from policy_probes.records import Record, is_finite_number
from policy_probes.sinks.base import MetricSink
from policy_probes.sinks.config import SinkSetup, default_console_metrics

SPARK = "▁▂▃▄▅▆▇█"
#: the live view is drawn again at most this often (seconds), however short the epochs
REFRESH_SECONDS = 0.5
UP, DOWN, FLAT = "↑", "↓", "→"
#: keys with at most this many '/'-separated parts count as shallow (shown at SNAPSHOT)
SHALLOW_PARTS = 2


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A glob where ``*`` matches within one ``/``-separated part (``?`` one character)."""
    wildcards = {"*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wildcards.get(ch) or re.escape(ch) for ch in pattern) + r"\Z")


def trend_arrow(previous: float | None, current: float, rtol: float = 1e-3) -> str:
    """↑ / ↓ when ``current`` moved by more than ``rtol`` (relative) from ``previous``, else →."""
    if previous is None or not (math.isfinite(previous) and math.isfinite(current)):
        return " "
    if abs(current - previous) <= 1e-12 + rtol * abs(previous):
        return FLAT
    return UP if current > previous else DOWN


def sparkline(values: Sequence[float]) -> str:
    """Unicode sparkline of ``values`` (min to max of the shown window)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, span = min(finite), max(finite) - min(finite)

    def char(v: float) -> str:
        if not math.isfinite(v):
            return " "
        if span <= 0:
            return SPARK[len(SPARK) // 2]
        return SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))]

    return "".join(map(char, values))


class _LiveView:
    """The renderable of the sink's ``Live``: the sink's live view as last drawn."""

    def __init__(self, sink: ConsoleSink) -> None:
        self.sink = sink

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.sink._live_segments(console, options)


def format_value(value: float | int) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


@register
class ConsoleSink(MetricSink):
    """Rich console output: live trend view and SNAPSHOT tables."""

    name = "console"

    @classmethod
    def from_setup(cls, setup: SinkSetup) -> ConsoleSink:
        return cls(setup.console, setup.sinks.console_metrics, setup.sinks.console_live)

    def __init__(
        self,
        console: Console | None = None,
        metrics: Sequence[str] | None = None,
        live: bool = True,
        history: int = 24,
        refresh_seconds: float = REFRESH_SECONDS,
    ) -> None:
        super().__init__()
        self.console = console if console is not None else Console(stderr=True)
        self.patterns = [
            pattern_regex(p) for p in (default_console_metrics() if metrics is None else metrics)
        ]
        self.live_enabled = live
        self.history = history
        self.refresh_seconds = refresh_seconds
        #: the live view as drawn (segments), its width, the data version it shows and
        #: when it was drawn (:meth:`_live_segments`)
        self._drawn: tuple[list[Any], int, int, float] | None = None
        self._version = 0
        self._lock = threading.Lock()
        self._series: dict[str, deque[float]] = {}  # chosen metrics only, bounded
        #: key -> :meth:`chosen`'s answer (a record repeats its ~200 keys every epoch)
        self._chosen: dict[str, int | None] = {}
        self._previous: dict[str, float] = {}
        self._latest: dict[str, float | int] = {}
        self._epoch_of: dict[str, int] = {}
        self._snapshot: dict[str, float | int] = {}
        self.epoch: int | None = None
        self.agent_step: int | None = None
        self._live: Live | None = None
        self._closed = False
        #: the run's findings as text, as last handed over, printed at close
        self.findings_text: str | None = None

    def chosen(self, key: str) -> int | None:
        """Index of the first pattern that selects ``key`` (its display order), else None."""
        if key not in self._chosen:
            matching = (i for i, regex in enumerate(self.patterns) if regex.match(key))
            self._chosen[key] = next(matching, None)
        return self._chosen[key]

    def emit(self, record: Record) -> None:
        # the live view is drawn on the progress bar's thread too: it reads the series
        # under the lock (and never takes a rich lock while holding it)
        with self._lock:
            if record.epoch != self.epoch:
                self._snapshot = {}
            self.epoch = record.epoch
            if record.agent_step is not None:
                self.agent_step = record.agent_step
            if record.findings_text is not None:
                self.findings_text = record.findings_text
            snapshot = record.hook_point == "SNAPSHOT"
            for key, value in record.metrics.items():
                chosen = self.chosen(key) is not None
                if not (chosen or (snapshot and key.count("/") < SHALLOW_PARTS)):
                    continue  # shown nowhere
                if not is_finite_number(value):
                    continue  # vectors, None, NaN and strings are not shown
                if chosen:
                    series = self._series.setdefault(key, deque(maxlen=self.history))
                    if self._epoch_of.get(key) == self.epoch:  # a second emit of this epoch
                        series[-1] = float(value)
                    else:
                        if key in self._latest:
                            self._previous[key] = float(self._latest[key])
                        series.append(float(value))
                    self._latest[key] = value
                    self._epoch_of[key] = self.epoch
                else:
                    self._snapshot[key] = value
            self._version += 1
        if snapshot:
            self.console.print(self.summary_table(title=f"snapshot, epoch {self.epoch}"))
        if self.live_enabled and self.console.is_terminal and not self._closed:
            if self._live is None:
                self._live = Live(
                    _LiveView(self), console=self.console, auto_refresh=False, transient=True
                )
                self._live.start()
            if self._redraw_due():
                self._live.refresh()

    def _redraw_due(self) -> bool:
        """Whether the live view is stale and ``refresh_seconds`` old (or never drawn)."""
        drawn = self._drawn
        if drawn is None:
            return True
        _, _, version, at = drawn
        return version != self._version and time.monotonic() - at >= self.refresh_seconds

    def _live_segments(self, console: Console, options: ConsoleOptions) -> list[Any]:
        """The live view drawn for ``options``, drawn again only when :meth:`_redraw_due`
        or the width changed (a progress bar on the same console redraws it ten times a
        second, and laying out its table costs milliseconds)."""
        drawn = self._drawn
        if drawn is None or drawn[1] != options.max_width or self._redraw_due():
            with self._lock:  # a consistent view of the series emit() is adding to
                view, version = self.live_view(), self._version
            segments = list(console.render(view, options))  # the table holds its strings
            drawn = self._drawn = (segments, options.max_width, version, time.monotonic())
        return drawn[0]

    def _rows(self) -> Iterator[tuple[str, str, str]]:
        """(key, value, trend arrow) of the chosen metrics, in their patterns' order."""
        for key in sorted(self._latest, key=lambda k: (self.chosen(k) or 0, k)):
            value = self._latest[key]
            yield key, format_value(value), trend_arrow(self._previous.get(key), float(value))

    def summary_table(self, title: str | None = None) -> Table:
        """Compact table of the chosen metrics (and the SNAPSHOT's shallow scalars)."""
        step = self.agent_step
        caption = f"agent_step {step:,}" if step is not None else None
        table = Table(title=title, caption=caption, show_edge=False, pad_edge=False, expand=False)
        table.add_column("metric", style="cyan", no_wrap=True)
        table.add_column("value", justify="right", no_wrap=True)
        table.add_column("", no_wrap=True)
        for row in self._rows():
            table.add_row(*row)
        for key in sorted(self._snapshot):
            table.add_row(key, format_value(self._snapshot[key]), "")
        return table

    def live_view(self) -> Table:
        """Live rows: metric, value, trend arrow, sparkline of recent epochs."""
        table = Table.grid(padding=(0, 1))
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(justify="right", no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(style="dim", no_wrap=True)
        for key, value, arrow in self._rows():
            table.add_row(key, value, arrow, sparkline(list(self._series[key])))
        return table

    def __rich__(self) -> Group:
        header = f"epoch {self.epoch}" if self.epoch is not None else "no epoch yet"
        return Group(Text(header, style="bold"), self.live_view())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._latest:
            ended = self.run_context.get("ended") or "final"  # e.g. "stopped by SIGTERM"
            self.console.print(self.summary_table(title=f"{ended}, epoch {self.epoch}"))
        if self.findings_text is not None:  # what is going wrong
            self.console.print(self.findings_text, markup=False, soft_wrap=True)
