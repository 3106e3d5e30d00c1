"""Findings: rules over a run's per-epoch metrics that say what is going wrong, with evidence.

A *finding* is a statement a user can act on: which measure crossed which threshold, for
which component or layer, since which epoch, how it has moved, where the threshold comes
from, which docs page explains the measure and which remedies address it
(:mod:`policy_probes.remedies`). The rules read trends, not single epochs: every rule
works on the rolling median over ``window`` epochs (one noisy epoch moves nothing),
compares it with the median of the run's first ``window`` epochs (the baseline), and
fires only when the condition holds at the run's last epoch and has held without a
break since; the *onset* is the first epoch of that stretch whose own value meets the
condition (where a climb crossed the threshold).

Findings are shown at the end of a run (console), at the top of ``report.html``, in the
W&B run summary and by ``policy-probes diagnose RUN_DIR [--json]``
(:mod:`policy_probes.diagnose`), which also works on a run still training: it reads
``metrics.jsonl`` as it stands.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

#: epochs of the rolling median and of the baseline (fewer on short runs, see :func:`window_for`)
WINDOW = 5
#: a series needs this many windows of epochs before a rule reads it: the baseline, the
#: rolling median at the end, and one window between them (shorter: too short to call a
#: trend; at the probes' default of one observed pass per epoch, shorter windows fired on
#: healthy 8-epoch runs)
MIN_WINDOWS = 3

DOCS = "docs/probes/"


@dataclass(frozen=True)
class Rule:
    """One rule: a per-epoch metric (``pattern``, a regex whose ``component`` group names
    the component or layer) and the condition that makes it a finding.

    ``kind="level"``: the rolling median is at or beyond ``threshold`` (above for
    ``"rising"``, below for ``"falling"``) and has moved by at least ``min_change`` from
    the baseline in that direction. ``kind="ratio"``: the rolling median divided by the
    baseline is at or beyond ``threshold`` (a factor: 2.0 = doubled, 0.2 = fell to a fifth),
    and the rolling median is at least ``floor`` in size (values near 0 make ratios noise)."""

    name: str
    title: str
    pattern: str
    direction: Literal["rising", "falling"]
    kind: Literal["level", "ratio"]
    threshold: float
    threshold_source: str
    docs: str
    remedies: tuple[str, ...]
    meaning: str
    min_change: float = 0.0
    floor: float = 0.0

    def matches(self, key: str) -> str | None:
        """The component of ``key`` when this rule reads it, else None."""
        m = re.fullmatch(self.pattern, key)
        if m is None:
            return None
        return m.groupdict().get("component") or key

    def holds(self, value: float, baseline: float) -> bool:
        if self.kind == "level":
            if self.direction == "rising":
                return value >= self.threshold and value - baseline >= self.min_change
            return value <= self.threshold and baseline - value >= self.min_change
        if baseline <= self.floor:  # too small to divide by (ratio rules read sizes >= 0)
            return (
                self.direction == "rising"
                and self.floor > 0
                and value >= self.threshold * self.floor
            )
        ratio = value / baseline
        return ratio >= self.threshold if self.direction == "rising" else ratio <= self.threshold


_C = r"(?P<component>[^/]+)"
PROJECT = "policy-probes default, not from a paper"

RULES: tuple[Rule, ...] = (
    Rule(
        name="dormant_units",
        title="dormant units are accumulating",
        pattern=rf"probes/relu/{_C}/dormant_fraction",
        direction="rising",
        kind="level",
        threshold=0.1,
        min_change=0.05,
        threshold_source=f"{PROJECT}; the dormancy score and tau = 0.025 are ReDo's "
        "(Sokar et al., ICML 2023)",
        docs=DOCS + "relu.md",
        remedies=("redo", "shrink_and_perturb", "reset_layers"),
        meaning="units whose mean |h| is at most tau of the layer mean: they pass almost no "
        "signal forward and get almost no gradient, so the layer has lost capacity",
    ),
    Rule(
        name="dead_units",
        title="dead ReLU units are accumulating",
        pattern=rf"probes/relu/{_C}/dead_fraction",
        direction="rising",
        kind="level",
        threshold=0.05,
        min_change=0.05,
        threshold_source=PROJECT,
        docs=DOCS + "relu.md",
        remedies=("redo", "reset_layers"),
        meaning="units never positive in an epoch get no gradient at all; they do not "
        "recover by themselves",
    ),
    Rule(
        name="churn_rising",
        title="policy churn is rising",
        pattern=rf"probes/churn/{_C}/policy_kl",
        direction="rising",
        kind="ratio",
        threshold=2.0,
        floor=1e-4,
        threshold_source=f"{PROJECT}; rising churn comes with plasticity loss in C-CHAIN "
        "(Tang et al., ICML 2025)",
        docs=DOCS + "churn.md",
        remedies=("churn reduction loss (C-CHAIN; not in policy_probes.remedies)",),
        meaning="one epoch of updates changes the policy more and more on states it did not "
        "train on: the updates interfere instead of generalise",
    ),
    Rule(
        name="value_churn_rising",
        title="value churn is rising",
        pattern=rf"probes/churn/{_C}/value_change",
        direction="rising",
        kind="ratio",
        threshold=2.0,
        floor=1e-4,
        threshold_source=f"{PROJECT}; C-CHAIN (Tang et al., ICML 2025) measures |dV| on "
        "held-out states",
        docs=DOCS + "churn.md",
        remedies=("churn reduction loss (C-CHAIN; not in policy_probes.remedies)",),
        meaning="one epoch of updates moves the value on states outside its data more and more",
    ),
    Rule(
        name="weight_norm_growth",
        title="weight norm keeps growing",
        pattern=rf"probes/weights/{_C}/norm",
        direction="rising",
        kind="ratio",
        threshold=1.5,
        floor=1e-6,
        threshold_source=f"{PROJECT}; parameter-norm growth is one of the three mechanisms "
        "of Lyle et al., 2024",
        docs=DOCS + "weights.md",
        remedies=("l2_init", "soft_shrink_perturb", "policy.layer_norm=true"),
        meaning="larger weights make units harder to move and the loss surface sharper",
    ),
    Rule(
        name="updates_stalled",
        title="updates barely move the weights",
        pattern=rf"probes/weights/{_C}/update_ratio",
        direction="falling",
        kind="ratio",
        threshold=0.2,
        floor=1e-9,
        threshold_source=f"{PROJECT} (an annealed learning rate lowers it by design)",
        docs=DOCS + "weights.md",
        remedies=("soft_shrink_perturb", "l2_init", "reset_layers"),
        meaning="each epoch's updates move the layer by a fifth or less of what they did at "
        "the start",
    ),
    Rule(
        name="preactivation_drift",
        title="pre-activations drift away from their early distribution",
        pattern=rf"probes/preactivation/{_C}/mean_drift",
        direction="rising",
        kind="level",
        threshold=1.0,
        min_change=0.5,
        threshold_source=f"{PROJECT}; pre-activation shift is one of the three mechanisms of "
        "Lyle et al., 2024",
        docs=DOCS + "preactivation.md",
        remedies=("policy.layer_norm=true", "soft_shrink_perturb", "reset_layers"),
        meaning="the mean pre-activation of the layer's units moved by more than one early "
        "standard deviation: units drift into saturation or into the dead side of the ReLU",
    ),
    Rule(
        name="fisher_collapse",
        title="the loss no longer depends on these parameters (Fisher trace collapsed)",
        pattern=rf"probes/fisher/{_C}/trace",
        direction="falling",
        kind="ratio",
        threshold=0.1,
        floor=1e-12,
        threshold_source=PROJECT,
        docs=DOCS + "fisher.md",
        remedies=("redo", "shrink_and_perturb", "reset_layers"),
        meaning="the per-sample gradients of the component's parameters fell to a tenth of "
        "their early size",
    ),
    Rule(
        name="gradient_noise_rising",
        title="gradient noise is drowning the gradient signal",
        pattern=rf"probes/fisher/{_C}/grad_noise_scale",
        direction="rising",
        kind="ratio",
        threshold=10.0,
        floor=1e-3,
        threshold_source=f"{PROJECT}; B_simple is McCandlish et al., 2018",
        docs=DOCS + "fisher.md",
        remedies=("larger minibatches", "lower learning rate"),
        meaning="the noise scale (the batch size at which the gradient signal matches its "
        "noise) grew tenfold: minibatch gradients point in ever more random directions",
    ),
    Rule(
        name="low_utility_units",
        title="units with no contribution are accumulating",
        pattern=rf"probes/utility/{_C}/low_utility_fraction",
        direction="rising",
        kind="level",
        threshold=0.1,
        min_change=0.05,
        threshold_source=f"{PROJECT}; the utility is continual backprop's (Dohare et al., "
        "Nature 2024)",
        docs=DOCS + "utility.md",
        remedies=("continual_backprop", "redo"),
        meaning="units whose contribution |h| * sum|w_out| is negligible next to the layer's",
    ),
    Rule(
        name="value_target_scale",
        title="the value targets' scale keeps growing",
        pattern=r"train/value_target_std",
        direction="rising",
        kind="ratio",
        threshold=4.0,
        floor=1e-6,
        threshold_source=f"{PROJECT}; target scale is one of the three mechanisms of Lyle "
        "et al., 2024",
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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def condition(self) -> str:
        """The threshold as a phrase (``>= 0.1``, ``x2 of baseline``)."""
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


def window_for(epochs: int, window: int = WINDOW) -> int | None:
    """The rolling window for a series of ``epochs`` epochs: ``window``, or None when the
    series is shorter than :data:`MIN_WINDOWS` windows (no finding then)."""
    return window if epochs >= MIN_WINDOWS * window else None


def series_of(records: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``key -> [(epoch, value)]`` of the finite scalars of POST_EPOCH records (records
    without a hook point count too); the last record of an epoch wins."""
    table: dict[str, dict[int, float]] = {}
    for rec in records:
        epoch = rec.get("epoch")
        if not isinstance(epoch, int) or rec.get("hook_point", "POST_EPOCH") != "POST_EPOCH":
            continue
        for key, value in rec.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if key in ("epoch", "agent_step", "time") or not math.isfinite(value):
                continue
            table.setdefault(key, {})[epoch] = float(value)
    return {k: sorted(v.items()) for k, v in table.items()}


def evaluate(
    rule: Rule, key: str, points: Sequence[tuple[int, float]], window: int = WINDOW
) -> Finding | None:
    """``rule`` on one series; a :class:`Finding` when it holds at the last epoch."""
    component = rule.matches(key)
    w = window_for(len(points), window)
    if component is None or w is None:
        return None
    epochs = [e for e, _ in points]
    values = [v for _, v in points]
    # medians: one noisy epoch (or two in a window of 5) moves neither
    baseline = statistics.median(values[:w])
    rolling = [statistics.median(values[i - w + 1 : i + 1]) for i in range(w - 1, len(values))]
    holds = [rule.holds(r, baseline) for r in rolling]
    if not holds[-1]:
        return None
    start = len(holds) - 1
    while start > 0 and holds[start - 1]:
        start -= 1
    # the onset: the first epoch of the first window that met the condition from which
    # the epoch's own value meets it too (where a step up or down happened)
    first = start  # index of that window's first epoch in ``values``
    onset = next(
        (epochs[i] for i in range(first, start + w) if rule.holds(values[i], baseline)),
        epochs[start + w - 1],
    )
    tail = list(zip(epochs, values, strict=True))[-2 * w :]
    return Finding(
        rule=rule.name,
        title=rule.title,
        metric=key,
        component=component,
        value=rolling[-1],
        baseline=baseline,
        slope=_slope(tail),
        window=w,
        onset_epoch=onset,
        last_epoch=epochs[-1],
        threshold=rule.threshold,
        threshold_kind=rule.kind,
        direction=rule.direction,
        threshold_source=rule.threshold_source,
        docs=rule.docs,
        remedies=list(rule.remedies),
        meaning=rule.meaning,
    )


def _slope(points: Sequence[tuple[int, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(e for e, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((e - mx) ** 2 for e, _ in points)
    return sum((e - mx) * (v - my) for e, v in points) / var if var else 0.0


def diagnose(
    records: Iterable[Mapping[str, Any]],
    rules: Sequence[Rule] = RULES,
    window: int = WINDOW,
) -> list[Finding]:
    """Every finding of ``rules`` on a run's records (``metrics.jsonl`` lines), earliest
    onset first. A component whose series is the same as one of its layers'
    (``actor_mlp`` is its last layer's output) is reported once, under the layer."""
    table = series_of(records)
    found: list[Finding] = []
    for rule in rules:
        hits = [f for key in sorted(table) if (f := evaluate(rule, key, table[key], window))]
        found += _drop_duplicates(hits, table)
    found.sort(key=lambda f: (f.onset_epoch, f.rule, f.component))
    return found


def _drop_duplicates(hits: list[Finding], table: Mapping[str, Any]) -> list[Finding]:
    out = []
    for f in hits:
        twin = any(
            g.component.startswith(f.component + ".") and table[g.metric] == table[f.metric]
            for g in hits
        )
        if not twin:
            out.append(f)
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a line still being written (a run in progress)
    or damaged is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def diagnose_run(run_dir: Path, window: int = WINDOW) -> list[Finding]:
    """:func:`diagnose` on ``run_dir/metrics.jsonl`` (``FileNotFoundError`` without one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: RUN_DIR must be a run directory written with the jsonl sink "
            f"on (sinks.jsonl=true)"
        )
    return diagnose(read_records(path), window=window)


def to_json(findings: Sequence[Finding]) -> str:
    return json.dumps({"findings": [f.to_dict() for f in findings]}, indent=2)


def from_json(text: str) -> list[Finding]:
    return [Finding.from_dict(d) for d in json.loads(text)["findings"]]


def render_text(findings: Sequence[Finding]) -> str:
    """Plain text for terminals and logs: one block per finding."""
    if not findings:
        return "no findings: no plasticity measure crossed its threshold as a trend"
    lines = [f"{len(findings)} finding(s):"]
    for f in findings:
        lines.append(f"- {f.summary()}")
        lines.append(f"    why it matters: {f.meaning}")
        lines.append(
            f"    trend: {_num(f.slope)} per epoch over the last epochs; rolling median of "
            f"{f.window} epochs; threshold from: {f.threshold_source}"
        )
        lines.append(f"    read: {f.docs}; remedies: {', '.join(f.remedies)}")
    return "\n".join(lines)


def render_html(findings: Sequence[Finding]) -> str:
    """An HTML section for the top of ``report.html``."""
    import html

    if not findings:
        return (
            '<h2 id="findings">Findings</h2><p class="note">No findings: no plasticity '
            "measure crossed its threshold as a trend (rolling medians, not single epochs).</p>"
        )
    rows = []
    for f in findings:
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(c))}</td>"
                for c in (
                    f.component,
                    f.title,
                    f"{f.metric.rsplit('/', 1)[-1]}: {_num(f.baseline)} → {_num(f.value)}",
                    f"{_num(f.slope)}/epoch",
                    f.onset_epoch,
                    f"{f.condition()} ({f.threshold_source})",
                    ", ".join(f.remedies),
                )
            )
            + f'<td><a href="{html.escape(f.docs)}">{html.escape(f.docs)}</a></td></tr>'
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "component",
            "finding",
            "evidence (baseline → now)",
            "trend",
            "since epoch",
            "threshold",
            "remedies",
            "read",
        )
    )
    return (
        '<h2 id="findings">Findings</h2><table class="findings"><thead><tr>'
        + head
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


class FindingsCollector:
    """The per-epoch values of the keys the rules read, kept from a sink's emits, so a
    sink can state the findings when the run ends (the console, the W&B run summary)."""

    def __init__(self, rules: Sequence[Rule] = RULES) -> None:
        self.rules = tuple(rules)
        self.records: dict[int, dict[str, Any]] = {}
        self._read: dict[str, bool] = {}
        #: the keys seen so far that the rules read (a record repeats its keys every
        #: epoch, and the rules read a few dozen of its hundreds)
        self._read_keys: list[str] = []

    def reads(self, key: str) -> bool:
        hit = self._read.get(key)
        if hit is None:
            hit = self._read[key] = any(r.matches(key) is not None for r in self.rules)
        return hit

    def add(self, metrics: Mapping[str, Any], epoch: int, hook_point: str) -> None:
        """Keep the epoch's scalars of the keys the rules read (POST_EPOCH records)."""
        if hook_point != "POST_EPOCH":
            return
        rec = self.records.setdefault(int(epoch), {"epoch": int(epoch)})
        new = metrics.keys() - self._read.keys()  # keys not seen before (a set)
        if new:
            self._read_keys += [k for k in metrics if k in new and self.reads(k)]  # in order
        for key in self._read_keys:
            value = metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                rec[key] = value

    def findings(self, run_dir: Path | None = None) -> list[Finding]:
        """The run's findings: from ``run_dir/metrics.jsonl`` when there is one (it holds
        the epochs before a resume too), else from what this collector kept."""
        if run_dir is not None and (Path(run_dir) / "metrics.jsonl").is_file():
            return diagnose_run(Path(run_dir))
        return diagnose(self.records.values(), self.rules)
