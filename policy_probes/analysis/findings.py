"""Findings: rules over a run's per-epoch metrics that say what is going wrong, with evidence
(``docs/findings.md``), and ``policy-probes diagnose``.

Two tiers. A **finding** is a direct test of what its text says (the trainability probe's
fit of new targets for "plasticity is lost", the value targets' own spread for their
scale). An **observation** is a measure's unusual trend, stated without a claim of harm.

A rule reads one series: the rolling median over ``window`` points against a trailing
baseline, the median of the ``window`` points that end ``lag`` points earlier (never the
run's first ``SKIP_WINDOWS`` windows, the start of learning). Once the condition holds the
baseline is frozen: the rule keeps holding while the rolling median meets the condition
against the level before the change, and clears when it no longer does. The *onset* is
the first point of the window that fired whose own value meets the condition."""

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

#: points of the rolling median and of the baseline window
WINDOW = 5
#: the trailing baseline ends this many windows before the last point
LAG_WINDOWS = 3
#: the run's first windows that never make a baseline (the start of learning)
SKIP_WINDOWS = 4
TIERS = ("finding", "observation")


#: the run-level rules: a key of the trainer's records, not a probe's metric
RUN_RULES: tuple[Rule, ...] = (
    Rule(
        name="value_target_scale",
        title="the value targets' spread grew tenfold",
        metric="train/value_target_std",
        direction="rising",
        kind="ratio",
        threshold=10.0,
        floor=1e-6,
        tier="finding",
        threshold_source="policy-probes default, not from a paper; target scale is one of "
        "the three mechanisms of plasticity loss in Lyle et al., 2024",
        docs="docs/trainer.md",
        remedies=("return / reward normalisation", "policy.layer_norm=true"),
        meaning="the value head now regresses on targets ten times as spread as a few "
        "epochs before (the std of the value targets is measured directly): rewards or "
        "returns changed scale, which the critic's weights and the optimizer must follow",
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
    #: rolling median over ``window`` points at the last epoch
    value: float
    #: median of the baseline window before the change (NaN: a level rule without one)
    baseline: float
    #: least-squares slope per epoch over the last ``2 * window`` points
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
    #: ``"finding"`` (a direct test) or ``"observation"`` (a trend, no claim of harm)
    tier: str = "observation"
    #: first and last epoch of the baseline window (None: no baseline)
    baseline_epochs: list[int] | None = None
    #: the record key the series was divided by
    divide_by: str | None = None

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
        name = self.metric.rsplit("/", 1)[-1]
        if self.divide_by is not None:
            name += f" / {self.divide_by.rsplit('/', 1)[-1]}"
        if self.baseline_epochs is None:
            moved = f"{name} {_num(self.value)}"
        else:
            first, last = self.baseline_epochs
            moved = f"{name} {_num(self.baseline)} (epochs {first}-{last}) -> {_num(self.value)}"
        return (
            f"{self.component}: {self.title} ({moved}, {self.condition()}, "
            f"since epoch {self.onset_epoch})"
        )


def _num(v: float) -> str:
    return f"{v:.3g}"


def default_rules() -> tuple[Rule, ...]:
    """Every registered probe's rules and :data:`RUN_RULES` (the default rules)."""
    import policy_probes.probes  # noqa: F401 - the built-in probes register their rules

    return plugins.findings_rules() + RUN_RULES


class _Trend:
    """One rule on one series, followed point by point: the last ``lag + window`` points
    (the rolling window, the trailing baseline window and the slope read them), the frozen
    baseline while the rule holds, and the onset."""

    def __init__(self, rule: Rule, key: str, component: str, window: int) -> None:
        self.rule, self.key, self.component = rule, key, component
        self.window = w = rule.window or window
        self.lag = rule.lag if rule.lag is not None else LAG_WINDOWS * w
        baseline = rule.needs_baseline
        #: points before the rule first judges: the skipped start, the baseline, the lag
        skip = SKIP_WINDOWS * w if rule.skip is None else rule.skip
        self.needed = skip + w + self.lag if baseline else w
        self.count = 0
        self.points: deque[tuple[int, float]] = deque(maxlen=max(self.lag + w, 2 * w))
        self.rolling = math.nan
        #: while the rule holds: the baseline it fired against and that window's epochs
        self.frozen: tuple[float, int, int] | None = None
        #: the stretch's onset epoch (None: the rule does not hold at the last point)
        self.onset: int | None = None

    def add(self, epoch: int, value: float) -> None:
        self.count += 1
        self.points.append((epoch, value))
        if self.count < self.needed:
            return
        w, holds = self.window, self.rule.holds
        window = list(itertools.islice(self.points, len(self.points) - w, None))
        self.rolling = statistics.median(v for _, v in window)  # one odd point moves nothing
        if self.onset is not None:
            if not holds(self.rolling, self.frozen[0] if self.frozen else None, held=True):
                self.onset, self.frozen = None, None
            return
        base: float | None = None
        if self.rule.needs_baseline:
            start = len(self.points) - self.lag - w
            before = list(itertools.islice(self.points, start, start + w))
            base = statistics.median(v for _, v in before)
        if holds(self.rolling, base):
            self.onset = next((e for e, v in window if holds(v, base)), epoch)
            self.frozen = None if base is None else (base, before[0][0], before[-1][0])

    def holds(self) -> bool:
        """Whether the rule holds at the last point."""
        return self.onset is not None

    def finding(self) -> Finding:
        """The finding, with its evidence, of a trend that :meth:`holds`."""
        rule = self.rule
        base, epochs = (
            (math.nan, None)
            if self.frozen is None
            else (
                self.frozen[0],
                [self.frozen[1], self.frozen[2]],
            )
        )
        tail = list(itertools.islice(self.points, max(0, len(self.points) - 2 * self.window), None))
        return Finding(
            rule=rule.name,
            title=rule.title,
            metric=self.key,
            component=self.component,
            value=self.rolling,
            baseline=base,
            slope=_slope(tail),
            window=self.window,
            onset_epoch=self.onset,
            last_epoch=self.points[-1][0],
            threshold=rule.threshold,
            threshold_kind=rule.kind,
            direction=rule.direction,
            threshold_source=rule.threshold_source,
            docs=rule.docs,
            remedies=list(rule.remedies),
            meaning=rule.meaning,
            tier=rule.tier,
            baseline_epochs=epochs,
            divide_by=rule.divide_by,
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
        self._divisors = {r.divide_by for r in self.rules if r.divide_by is not None}
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

    def reads(self, key: str) -> bool:
        """Whether a rule reads ``key`` (its series, or a series it divides by)."""
        return key in self._divisors or bool(self.rules_of(key))

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
            since = trend.points[-1][0] if trend.points else None
            points = _points_after(scalars[trend.key], since)
            if trend.rule.divide_by is not None:
                points = _divided(points, scalars.get(trend.rule.divide_by, {}))
            fed[trend] = points
            for epoch, value in points:
                trend.add(epoch, value)
        for pair, equal in self._twins.items():
            if equal:  # still equal: equal as long as they gain the same points
                self._twins[pair] = fed[pair[0]] == fed[pair[1]]

    def coverage(self, epochs: int) -> Coverage:
        """Which rules could judge the ``epochs`` epoch records read so far."""
        most: dict[str, tuple[int, int]] = {}  # rule -> (most points, points needed)
        for trend in self._trends.values():
            n, _ = most.get(trend.rule.name, (0, trend.needed))
            most[trend.rule.name] = (max(n, trend.count), trend.needed)
        judged = [rule for rule, (n, need) in most.items() if n >= need]
        short = {rule: n for rule, (n, need) in most.items() if n < need}
        needed = {rule: need for rule, (n, need) in most.items() if n < need}
        return Coverage(epochs, needed, self.window, judged, short)

    def _pair(self, trend: _Trend, other: _Trend) -> None:
        """Follow whether a component's series equals one of its layers' (both new)."""
        if other.rule is not trend.rule:
            return
        equal = not other.points
        if other.component.startswith(trend.component + "."):
            self._twins[(trend, other)] = equal
        elif trend.component.startswith(other.component + "."):
            self._twins[(other, trend)] = equal

    def findings(self) -> list[Finding]:
        """Every finding and observation at the last update, findings first, then by
        earliest onset; a component whose series equals one of its layers' (its last
        layer's output) is reported under the layer."""
        held = {t for t in self._trends.values() if t.holds()}
        held -= {outer for (outer, inner), equal in self._twins.items() if equal and inner in held}
        ordered = sorted(held, key=lambda t: (self.rules.index(t.rule), t.key))
        found = [t.finding() for t in ordered]
        found.sort(key=lambda f: (TIERS.index(f.tier), f.onset_epoch, f.rule, f.component))
        return found


def _divided(
    points: list[tuple[int, float]], divisor: Mapping[int, Any]
) -> list[tuple[int, float]]:
    """``points`` divided by ``divisor``'s value at the same epoch (points without a
    finite, non-zero divisor are left out)."""
    out = []
    for epoch, value in points:
        d = divisor.get(epoch)
        if type(d) is float and math.isfinite(d) and d != 0.0:
            out.append((epoch, value / d))
    return out


@dataclass
class Coverage:
    """What the rules could judge: a rule judges once one of its series holds the points
    it needs (the skipped start, the baseline window and the lag; a level rule without a
    baseline, one window); ``diagnose`` says so when none could."""

    #: epochs with a record in the run
    epochs: int
    #: rule -> points its series needs, for the rules in ``too_short``
    needed: dict[str, int]
    window: int
    #: rules that read a series long enough
    judged: list[str] = field(default_factory=list)
    #: rule -> the most points any of its series holds, for rules that read none long enough
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
        rules = ", ".join(
            f"{rule} ({n} of {self.needed[rule]})" for rule, n in sorted(self.too_short.items())
        )
        need = (
            f"a rule compares its last {self.window} epochs with {self.window} epochs "
            f"{LAG_WINDOWS} windows earlier, never the first {SKIP_WINDOWS * self.window}"
        )
        if self.judged:
            return f"not judged, too few epochs of their measure ({need}): {rules}"
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
    return judge(RunRecords.read(run_dir), run_rules(run_dir), window)


def judge(
    records: RunRecords, rules: Sequence[Rule], window: int = WINDOW
) -> tuple[list[Finding], Coverage]:
    """The findings of ``rules`` on ``records`` and what they could judge."""
    engine = FindingsEngine(rules, window)
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
    """Plain text for terminals and logs: the findings, then the observations, one block
    each; with ``coverage``, what could not be judged (a run too short for every rule gets
    that alone)."""
    unjudged = None if coverage is None else coverage.unjudged()
    if unjudged is not None and not coverage.judged:
        return unjudged
    if unjudged is not None:
        return f"{render_text(findings)}\n{unjudged}"
    tiers = {t: [f for f in findings if f.tier == t] for t in TIERS}
    lines = []
    if tiers["finding"]:
        lines.append(f"{len(tiers['finding'])} finding(s):")
    else:
        lines.append("no findings: no direct test shows a problem")
    for f in tiers["finding"]:
        lines += _block(f)
    if tiers["observation"]:
        lines.append(
            f"{len(tiers['observation'])} observation(s): unusual trends, not evidence of "
            f"harm by themselves:"
        )
    for f in tiers["observation"]:
        lines += _block(f)
    return "\n".join(lines)


def _block(f: Finding) -> list[str]:
    return [
        f"- {f.summary()}",
        f"    what it shows: {f.meaning}",
        f"    trend: {_num(f.slope)} per epoch over the last epochs; rolling median of "
        f"{f.window} points; threshold from: {f.threshold_source}",
        f"    read: {f.docs}; remedies: {', '.join(f.remedies)}",
    ]


_HTML_COLUMNS = ("tier", "component", "what", "evidence (baseline → now)", "trend", "since epoch")
_HTML_COLUMNS += ("threshold", "remedies", "read")


def render_html(findings: Sequence[Finding], coverage: Coverage | None = None) -> str:
    """An HTML section for the top of ``report.html``; with ``coverage``, what could not
    be judged (a run too short for every rule says so instead of "no findings")."""
    unjudged = None if coverage is None else coverage.unjudged()
    if unjudged is not None and not coverage.judged:
        return f'<h2 id="findings">Findings</h2><p class="note">{html.escape(unjudged)}.</p>'
    if unjudged is not None:
        note = f'<p class="note">{html.escape(unjudged)}.</p>'
        return render_html(findings).replace("</h2>", "</h2>" + note, 1)
    if not findings:
        return (
            '<h2 id="findings">Findings</h2><p class="note">No findings and no observations: '
            "no rule's condition holds at the last epoch (rolling medians against trailing "
            "baselines, not single epochs).</p>"
        )
    rows = []
    for f in findings:
        cells = (
            f.tier,
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
