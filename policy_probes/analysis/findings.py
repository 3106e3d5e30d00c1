"""Findings: rules over a run's per-epoch metrics that say what is going wrong, with evidence
(``docs/findings.md``), and ``policy-probes diagnose``.

A rule reads trends: the rolling median over ``window`` epochs against the median of the
first ``window`` (the baseline). It fires when its condition holds at the last epoch and
has held without a break since; the *onset* is the first epoch of that stretch whose own
value meets it. A finding says what crossed which threshold, where, since when, the
threshold's source, the docs page and the remedies."""

from __future__ import annotations

import argparse
import html
import itertools
import json
import math
import statistics
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from policy_probes import plugins
from policy_probes.plugins import Rule
from policy_probes.records import RunRecords

#: epochs of the rolling median and of the baseline
WINDOW = 5
#: a series needs this many windows of epochs before a rule reads it: the baseline, the
#: rolling median at the end, and one window between them (shorter fired on healthy runs)
MIN_WINDOWS = 3


#: the run-level rules: a key of the trainer's records, not a probe's metric
RUN_RULES: tuple[Rule, ...] = (
    Rule(
        name="value_target_scale",
        title="the value targets' scale keeps growing",
        metric="train/value_target_std",
        direction="rising",
        kind="ratio",
        threshold=4.0,
        floor=1e-6,
        threshold_source="policy-probes default, not from a paper; target scale is one of "
        "the three mechanisms of Lyle et al., 2024",
        docs="docs/trainer.md",
        remedies=("return / reward normalisation", "policy.layer_norm=true"),
        meaning="the value head regresses on targets four times as spread as at the start",
    ),
)


@dataclass
class Finding:
    """One rule that holds for one component or layer, with its evidence."""

    rule: str
    title: str
    #: the metric key the rule read
    metric: str
    #: the component or layer (``actor_mlp.layer_0``), or the key for run-level metrics
    component: str
    #: rolling median over ``window`` epochs at the last epoch
    value: float
    #: median of the run's first ``window`` epochs
    baseline: float
    #: least-squares slope per epoch over the last ``2 * window`` epochs
    slope: float
    window: int
    #: the first epoch from which the condition has held to the end
    onset_epoch: int
    last_epoch: int
    threshold: float
    threshold_kind: str
    direction: str
    threshold_source: str
    docs: str
    remedies: list[str] = field(default_factory=list)
    meaning: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The finding as a plain dict (the fields in order; what ``--json`` writes)."""
        return {**vars(self), "remedies": list(self.remedies)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def condition(self) -> str:
        """The threshold as a phrase (``>= 0.1``, ``>= 2 x baseline``)."""
        op = ">=" if self.direction == "rising" else "<="
        if self.threshold_kind == "ratio":
            return f"{op} {self.threshold:g} x baseline"
        return f"{op} {self.threshold:g}"

    def summary(self) -> str:
        """One line: what, where, how much, since when."""
        return (
            f"{self.component}: {self.title} ({self.metric.rsplit('/', 1)[-1]} "
            f"{_num(self.baseline)} -> {_num(self.value)}, {self.condition()}, "
            f"since epoch {self.onset_epoch})"
        )


def _num(v: float) -> str:
    return f"{v:.3g}"


def default_rules() -> tuple[Rule, ...]:
    """Every registered probe's rules and :data:`RUN_RULES` (the default rules)."""
    import policy_probes.probes  # noqa: F401 - the built-in probes register their rules

    return plugins.findings_rules() + RUN_RULES


class _Trend:
    """One rule on one series, followed point by point: the baseline, the last
    ``2 * window`` points (the rolling median and the slope read them), and the onset."""

    def __init__(self, rule: Rule, key: str, component: str, window: int) -> None:
        self.rule, self.key, self.component = rule, key, component
        self.count = 0
        self.last: deque[float] = deque(maxlen=window)  # the rolling window's values
        self.tail: deque[tuple[int, float]] = deque(maxlen=2 * window)
        self.baseline: float | None = None
        self.rolling = math.nan
        #: the stretch's onset epoch (None: the rule does not hold at the last epoch)
        self.onset: int | None = None

    def add(self, epoch: int, value: float) -> None:
        self.count += 1
        self.tail.append((epoch, value))
        self.last.append(value)
        if len(self.last) < self.last.maxlen:
            return
        if self.baseline is None:  # medians: one noisy epoch moves neither
            self.baseline = statistics.median(self.last)
        self.rolling = statistics.median(self.last)
        holds = self.rule.holds
        if not holds(self.rolling, self.baseline):
            self.onset = None
        elif self.onset is None:
            # the stretch starts with this window: at its first epoch that meets it too
            window = itertools.islice(self.tail, len(self.tail) - len(self.last), None)
            self.onset = next((e for e, v in window if holds(v, self.baseline)), epoch)

    def holds(self, window: int) -> bool:
        """Whether the rule holds at the last epoch (of :data:`MIN_WINDOWS` windows at least)."""
        return self.onset is not None and self.count >= MIN_WINDOWS * window

    def finding(self, window: int) -> Finding:
        """The finding, with its evidence, of a trend that :meth:`holds`."""
        rule = self.rule
        return Finding(
            rule=rule.name,
            title=rule.title,
            metric=self.key,
            component=self.component,
            value=self.rolling,
            baseline=self.baseline,
            slope=_slope(self.tail),
            window=window,
            onset_epoch=self.onset,
            last_epoch=self.tail[-1][0],
            threshold=rule.threshold,
            threshold_kind=rule.kind,
            direction=rule.direction,
            threshold_source=rule.threshold_source,
            docs=rule.docs,
            remedies=list(rule.remedies),
            meaning=rule.meaning,
        )


def _slope(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope per epoch of ``points``."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(e for e, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((e - mx) ** 2 for e, _ in points)
    return sum((e - mx) * (v - my) for e, v in points) / var if var else 0.0


class FindingsEngine:
    """The rules over a :class:`~policy_probes.records.RunRecords` as it grows: each
    :meth:`update` reads only the points gained since the last one (all again when the
    store's ``revision`` moved), so an epoch costs the same however long the run is."""

    def __init__(self, rules: Sequence[Rule] | None = None, window: int = WINDOW) -> None:
        self.rules = tuple(default_rules() if rules is None else rules)
        self.window = window
        self._matches: dict[str, list[tuple[Rule, str]]] = {}
        self._reset()

    def _reset(self) -> None:
        self._trends: dict[tuple[str, str], _Trend] = {}  # (rule name, key) -> its trend
        self._followed: set[str] = set()
        #: (trend, trend of a layer inside its component) -> their series are equal so far
        self._twins: dict[tuple[_Trend, _Trend], bool] = {}
        self._revision: int | None = None

    def rules_of(self, key: str) -> list[tuple[Rule, str]]:
        """The rules that read ``key``, each with the component it names."""
        found = self._matches.get(key)
        if found is None:
            found = self._matches[key] = [
                (rule, component) for rule in self.rules if (component := rule.matches(key))
            ]
        return found

    def update(self, records: RunRecords) -> None:
        """Read the points ``records`` gained since the last update."""
        if records.revision != self._revision:
            self._reset()  # an epoch was rewritten: read every point again
            self._revision = records.revision
        scalars = records.scalars
        if len(scalars) != len(self._followed):  # keys are only ever added
            for key in sorted(scalars.keys() - self._followed):
                self._followed.add(key)
                for rule, component in self.rules_of(key):
                    trend = _Trend(rule, key, component, self.window)
                    for other in self._trends.values():
                        self._pair(trend, other)
                    self._trends[(rule.name, key)] = trend
        fed: dict[_Trend, list[tuple[int, float]]] = {}
        for trend in self._trends.values():
            since = trend.tail[-1][0] if trend.tail else None
            points = fed[trend] = _points_after(scalars[trend.key], since)
            for epoch, value in points:
                trend.add(epoch, value)
        for pair, equal in self._twins.items():
            if equal:  # still equal: equal as long as they gain the same points
                self._twins[pair] = fed[pair[0]] == fed[pair[1]]

    def coverage(self, epochs: int) -> Coverage:
        """Which rules could judge the ``epochs`` epoch records read so far."""
        needed = MIN_WINDOWS * self.window
        most: dict[str, int] = {}
        for trend in self._trends.values():
            most[trend.rule.name] = max(most.get(trend.rule.name, 0), trend.count)
        judged = [rule for rule, n in most.items() if n >= needed]
        short = {rule: n for rule, n in most.items() if n < needed}
        return Coverage(epochs, needed, self.window, judged, short)

    def _pair(self, trend: _Trend, other: _Trend) -> None:
        """Follow whether a component's series equals one of its layers' (both new)."""
        if other.rule is not trend.rule:
            return
        equal = not other.tail
        if other.component.startswith(trend.component + "."):
            self._twins[(trend, other)] = equal
        elif trend.component.startswith(other.component + "."):
            self._twins[(other, trend)] = equal

    def findings(self) -> list[Finding]:
        """Every finding at the last update, earliest onset first; a component whose series
        equals one of its layers' (its last layer's output) is reported under the layer."""
        held = {t for t in self._trends.values() if t.holds(self.window)}
        held -= {outer for (outer, inner), equal in self._twins.items() if equal and inner in held}
        ordered = sorted(held, key=lambda t: (self.rules.index(t.rule), t.key))
        found = [t.finding(self.window) for t in ordered]
        found.sort(key=lambda f: (f.onset_epoch, f.rule, f.component))
        return found


@dataclass
class Coverage:
    """What the rules could judge: a rule judges once one of its series spans
    :data:`MIN_WINDOWS` windows; ``diagnose`` says so when none could."""

    #: epochs with a record in the run
    epochs: int
    #: epochs a rule's series needs (``MIN_WINDOWS * window``)
    needed: int
    window: int
    #: rules that read a series long enough
    judged: list[str] = field(default_factory=list)
    #: rule -> the most epochs any of its series holds, for rules that read none long enough
    too_short: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def unjudged(self) -> str | None:
        """Why nothing, or what, could not be judged (None: every rule that read a series
        judged it)."""
        if not self.too_short and self.judged:
            return None
        if self.epochs == 0:
            return "nothing could be judged: the run has no epoch record"
        if not self.judged and not self.too_short:
            return (
                f"nothing could be judged: none of the {self.epochs} epoch records holds a "
                f"measure a rule reads (the rules read the probes' metrics; attach probes: "
                f"`policy-probes plugins --kind probe`)"
            )
        rules = ", ".join(f"{rule} ({n} epochs)" for rule, n in sorted(self.too_short.items()))
        need = (
            f"a rule needs {self.needed} epochs of its measure ({MIN_WINDOWS} windows of "
            f"{self.window} epochs, the window)"
        )
        if self.judged:
            return f"not judged, too few epochs ({need}): {rules}"
        return (
            f"nothing could be judged: the run has {self.epochs} epoch records and {need}; "
            f"too few epochs for {rules}"
        )


def _points_after(series: Mapping[int, Any], epoch: int | None) -> list[tuple[int, float]]:
    """The finite floats of ``series`` after ``epoch`` (None: all), in epoch order."""
    if epoch is None:
        items = sorted(series.items())
    else:  # from the newest back as far as ``epoch``
        items = list(itertools.takewhile(lambda it: it[0] > epoch, reversed(series.items())))
        items.reverse()
    return [(e, v) for e, v in items if type(v) is float and math.isfinite(v)]


def diagnose(
    records: RunRecords | Iterable[Mapping[str, Any]],
    rules: Sequence[Rule] | None = None,
    window: int = WINDOW,
) -> list[Finding]:
    """Every finding of ``rules`` (default :func:`default_rules`) on a run's records or
    ``metrics.jsonl`` lines, earliest onset first."""
    if not isinstance(records, RunRecords):
        records = RunRecords().extend(records)
    engine = FindingsEngine(rules, window)
    engine.update(records)
    return engine.findings()


def diagnose_run(run_dir: Path, window: int = WINDOW) -> list[Finding]:
    """:func:`diagnose` on ``run_dir/metrics.jsonl`` with :func:`run_rules`."""
    return diagnose_with_coverage(run_dir, window)[0]


def diagnose_with_coverage(run_dir: Path, window: int = WINDOW) -> tuple[list[Finding], Coverage]:
    """:func:`diagnose_run` and what its rules could judge (:class:`Coverage`)."""
    records = RunRecords.read(run_dir)
    engine = FindingsEngine(run_rules(run_dir), window)
    engine.update(records)
    return engine.findings(), engine.coverage(len(records.epochs))


def run_rules(run_dir: Path) -> tuple[Rule, ...]:
    """:func:`default_rules` once the run's ``plugin_modules`` (config.json) are imported."""
    path = Path(run_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    plugins.import_modules(config.get("plugin_modules") if isinstance(config, dict) else None)
    return default_rules()


def to_json(findings: Sequence[Finding], coverage: Coverage | None = None) -> str:
    out: dict[str, Any] = {"findings": [f.to_dict() for f in findings]}
    if coverage is not None:
        out["coverage"] = coverage.to_dict()
    return json.dumps(out, indent=2)


def from_json(text: str) -> list[Finding]:
    return [Finding.from_dict(d) for d in json.loads(text)["findings"]]


def render_text(findings: Sequence[Finding], coverage: Coverage | None = None) -> str:
    """Plain text for terminals and logs: one block per finding; with ``coverage``, what
    could not be judged (a run too short for every rule gets that alone)."""
    unjudged = None if coverage is None else coverage.unjudged()
    if unjudged is not None and not coverage.judged:
        return unjudged
    if unjudged is not None:
        return f"{render_text(findings)}\n{unjudged}"
    if not findings:
        return "no findings: no plasticity measure crossed its threshold as a trend"
    lines = [f"{len(findings)} finding(s):"]
    for f in findings:
        lines += [
            f"- {f.summary()}",
            f"    why it matters: {f.meaning}",
            f"    trend: {_num(f.slope)} per epoch over the last epochs; rolling median of "
            f"{f.window} epochs; threshold from: {f.threshold_source}",
            f"    read: {f.docs}; remedies: {', '.join(f.remedies)}",
        ]
    return "\n".join(lines)


_HTML_COLUMNS = ("component", "finding", "evidence (baseline → now)", "trend", "since epoch")
_HTML_COLUMNS += ("threshold", "remedies", "read")


def render_html(findings: Sequence[Finding]) -> str:
    """An HTML section for the top of ``report.html``."""
    if not findings:
        return (
            '<h2 id="findings">Findings</h2><p class="note">No findings: no plasticity '
            "measure crossed its threshold as a trend (rolling medians, not single epochs).</p>"
        )
    rows = []
    for f in findings:
        cells = (
            f.component,
            f.title,
            f"{f.metric.rsplit('/', 1)[-1]}: {_num(f.baseline)} → {_num(f.value)}",
            f"{_num(f.slope)}/epoch",
            f.onset_epoch,
            f"{f.condition()} ({f.threshold_source})",
            ", ".join(f.remedies),
        )
        tds = "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
        docs = html.escape(f.docs)
        rows.append(f'<tr>{tds}<td><a href="{docs}">{docs}</a></td></tr>')
    head = "".join(f"<th>{h}</th>" for h in _HTML_COLUMNS)
    return (
        f'<h2 id="findings">Findings</h2><table class="findings"><thead><tr>{head}</tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def add_diagnose_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """``policy-probes diagnose RUN_DIR [--json] [--window N]``."""
    p = subparsers.add_parser(
        "diagnose",
        help="what is going wrong in a run: findings with evidence and remedies",
        description="Read RUN_DIR/metrics.jsonl (also while the run is training) and print "
        "the findings of the plasticity rules: which measure crossed which threshold as a "
        "trend, for which component or layer, since which epoch, and what to do about it.",
    )
    p.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"epochs of the rolling median and of the baseline (default {WINDOW})",
    )
    p.set_defaults(handler=diagnose_command)


#: ``diagnose``'s exit status when no rule had enough epochs to judge (docs/findings.md)
EXIT_NOT_JUDGED = 3


def cli_error(command: str, message: str) -> int:
    """Print ``policy-probes COMMAND: error: MESSAGE`` to stderr; returns the exit status 2."""
    print(f"policy-probes {command}: error: {message}", file=sys.stderr)
    return 2


def diagnose_command(args: argparse.Namespace) -> int:
    """Handler of ``diagnose``: 0 (findings or none), 2 when RUN_DIR has no metrics,
    :data:`EXIT_NOT_JUDGED` when no rule had enough epochs to judge."""
    if args.window < 1:
        return cli_error("diagnose", "--window must be >= 1")
    try:
        findings, coverage = diagnose_with_coverage(args.run_dir, window=args.window)
    except FileNotFoundError as exc:
        return cli_error("diagnose", str(exc))
    print(to_json(findings, coverage) if args.json else render_text(findings, coverage))
    return 0 if coverage.judged else EXIT_NOT_JUDGED
