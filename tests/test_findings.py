"""The findings engine on constructed runs, each case checked against a hand computation
of the documented rule (docs/findings.md): every rule at its exact threshold, the
trailing baseline (never the start of learning), its lag, the frozen baseline once a rule
fires, the onset, the slope window, the minimum length, duplicated epochs, a component
reported under its layer, the floor of ratio rules, the learning rate an update ratio is
divided by, the two tiers; and the same findings from the CLI, the console, W&B, the
report, a live session and a resumed one."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from policy_probes.analysis.findings import (
    LAG_WINDOWS,
    SKIP_WINDOWS,
    WINDOW,
    FindingsEngine,
    default_rules,
    diagnose,
    diagnose_run,
    from_json,
    render_text,
)
from policy_probes.analysis.live import LiveAnalysis
from policy_probes.cli import main
from policy_probes.plugins import Rule
from policy_probes.records import Record, RunRecords, read_jsonl

EPOCHS = 60
LR = "train/learning_rate"
DORMANT = "probes/relu/actor_mlp.layer_1/dormant_fraction_ref"


def rule_named(name: str) -> Rule:
    (rule,) = [r for r in default_rules() if r.name == name]
    return rule


def healthy_record(epoch: int, rng: random.Random) -> dict:
    """Flat measures with noise, as a run that keeps learning shows them."""
    return {
        "epoch": epoch,
        "hook_point": "POST_EPOCH",
        "agent_step": 512 * epoch,
        "rollout/episode_return": 100 + rng.uniform(-20, 20),
        "probes/relu/actor_mlp.layer_0/dormant_fraction_ref": 0.02 + rng.uniform(-0.015, 0.015),
        DORMANT: 0.03 + rng.uniform(-0.02, 0.02),
        "probes/relu/actor_mlp.layer_0/dead_fraction_ref": 0.0,
        "probes/utility/actor_mlp.layer_0/low_utility_fraction_ref": 0.05,
        "probes/churn/policy/policy_kl": 1e-3 * (1 + rng.uniform(-0.3, 0.3)),
        "probes/churn/policy/value_change": 0.05 * (1 + rng.uniform(-0.3, 0.3)),
        "probes/weights/actor_mlp.layer_0.linear/norm": 5.0 + 0.01 * epoch,
        "probes/weights/actor_mlp.layer_0.linear/update_ratio": 0.01 * (1 + rng.uniform(-0.2, 0.2)),
        LR: 2.5e-4,
        "train/value_target_std": 3.0 * (1 + rng.uniform(-0.1, 0.1)),
    }


def healthy_run(seed: int = 0, epochs: int = EPOCHS) -> list[dict]:
    rng = random.Random(seed)
    return [healthy_record(e, rng) for e in range(1, epochs + 1)]


def with_series(records: list[dict], key: str, value_at) -> list[dict]:
    for rec in records:
        rec[key] = value_at(rec["epoch"])
    return records


def dormant_jump(epoch: int) -> float:
    """0.05 until epoch 45, 0.4 from epoch 46 on."""
    return 0.05 if epoch <= 45 else 0.4


def sizes(rule: Rule) -> tuple[int, int, int]:
    """(window, lag, points needed) of ``rule`` as docs/findings.md states them."""
    w = rule.window or WINDOW
    lag = LAG_WINDOWS * w if rule.lag is None else rule.lag
    skip = SKIP_WINDOWS * w if rule.skip is None else rule.skip
    needed = skip + w + lag if rule.kind == "ratio" or rule.min_change > 0 else w
    return w, lag, needed


def key_of(rule: Rule) -> str:
    if rule.probe is None:
        return rule.metric
    return f"probes/{rule.probe}/actor_mlp.layer_0/{rule.metric}"


def step_run(rule: Rule, before: float, after: float, n: int, lr: float = 0.5) -> list[dict]:
    """``n`` epochs of ``rule``'s series: ``before`` for the skipped start and the baseline
    window, ``after`` from then on (with the learning rate ``lr`` it may divide by)."""
    w, _, _ = sizes(rule)
    skip = SKIP_WINDOWS * w if rule.skip is None else rule.skip
    change = skip + w if rule.kind == "ratio" or rule.min_change > 0 else 0
    # the series as the rule reads it is value / lr: give it value * lr
    scale = lr if rule.divide_by is not None else 1.0
    run = []
    for e in range(1, n + 1):
        rec = {"epoch": e, "hook_point": "POST_EPOCH", LR: lr}
        rec[key_of(rule)] = (before if e <= change else after) * scale
        run.append(rec)
    return run


def rules_found(run: list[dict]) -> list[str]:
    return [f.rule for f in diagnose(run)]


def boundary(rule: Rule) -> tuple[float, float, float]:
    """(baseline, value exactly at the threshold, value just short of it) by hand."""
    rising = rule.direction == "rising"
    short = -math.inf if rising else math.inf
    if rule.kind == "ratio":
        base = 2.0  # above every rule's floor; x 2 and / 2 are exact
        at = base * rule.threshold
        return base, at, math.nextafter(at, short)
    base = 0.0 if rising else 1.0
    at = rule.threshold
    assert (at - base if rising else base - at) >= rule.min_change  # the level decides
    return base, at, math.nextafter(at, short)


@pytest.mark.parametrize("name", [r.name for r in default_rules()])
def test_every_rule_fires_at_its_exact_threshold_and_not_just_short_of_it(name: str) -> None:
    rule = rule_named(name)
    _, _, needed = sizes(rule)
    base, at, short = boundary(rule)
    assert rules_found(step_run(rule, base, at, needed)) == [name]
    assert rules_found(step_run(rule, base, short, needed)) == []
    # the minimum length: one epoch fewer (the first) and nothing is judged
    assert rules_found(step_run(rule, base, at, needed)[1:]) == []


def test_a_level_rule_needs_its_change_over_the_baseline_exactly() -> None:
    rule = Rule(
        name="r",
        title="t",
        metric="m",
        direction="rising",
        kind="level",
        threshold=0.25,
        min_change=0.125,
        threshold_source="",
        docs="",
        remedies=(),
        meaning="",
        probe="p",
    )
    _, _, needed = sizes(rule)
    assert needed == 40  # 20 skipped + 5 of baseline + 15 of lag
    # 0.5 - 0.375 is 0.125 exactly; the next float above 0.375 leaves less than 0.125
    assert diagnose(step_run(rule, 0.375, 0.5, needed), rules=[rule])
    assert not diagnose(step_run(rule, math.nextafter(0.375, 1), 0.5, needed), rules=[rule])
    # falling: the mirror image
    falling = Rule(**{**vars(rule), "direction": "falling", "threshold": 0.5})
    assert diagnose(step_run(falling, 0.625, 0.5, needed), rules=[falling])
    assert not diagnose(step_run(falling, math.nextafter(0.625, 0), 0.5, needed), rules=[falling])


def test_plasticity_lost_needs_the_jump_and_the_level_both() -> None:
    """The trainability ratio x2.5 from 0.56 to 1.4 is a jump to a level fresh networks
    about match: no finding; to 1.5 exactly (x2.68) it is one; from 1.2 to 2.3 (x1.92,
    short of x2) it is not; from 2.0 to 4.0 (x2 exactly) it is."""
    rule = rule_named("plasticity_lost")
    assert (rule.tier, rule.threshold, rule.release, rule.level) == ("finding", 2.0, 1.4, 1.5)
    _, _, needed = sizes(rule)
    assert needed == 3  # the first measurement skipped, the baseline, the one judged
    assert rules_found(step_run(rule, 0.56, 1.4, needed)) == []
    assert rules_found(step_run(rule, 0.56, 1.5, needed)) == ["plasticity_lost"]
    assert rules_found(step_run(rule, 1.2, 2.3, needed)) == []
    assert rules_found(step_run(rule, 2.0, 4.0, needed)) == ["plasticity_lost"]


def test_a_rule_that_holds_releases_at_its_release_threshold() -> None:
    """plasticity_lost fires at x2 and then holds down to x1.4 of the frozen baseline
    (and the 1.5 level): 1.0 -> 2.0 -> 1.4 still holds, -> the next float below 1.4 clears."""
    rule = rule_named("plasticity_lost")
    run = step_run(rule, 1.0, 2.0, 3)
    key = key_of(rule)
    after = [dict(run[-1], epoch=4, **{key: 1.6}), dict(run[-1], epoch=5, **{key: 1.4 * 1.0})]
    assert rules_found(run + after[:1]) == ["plasticity_lost"]  # x1.6: held
    low = dict(after[0], epoch=5, **{key: math.nextafter(1.5, 0)})  # below the level
    assert rules_found(run + [after[0], low]) == []
    rel = Rule(**{**vars(rule), "level": None})  # the release alone: x1.4 exactly holds
    assert diagnose(run + [after[0], dict(after[0], epoch=5, **{key: 1.4})], rules=[rel])
    short = dict(after[0], epoch=5, **{key: math.nextafter(1.4, 0)})
    assert not diagnose(run + [after[0], short], rules=[rel])


def test_a_healthy_run_yields_nothing() -> None:
    for seed in range(5):
        assert diagnose(healthy_run(seed)) == [], seed


def test_the_start_of_learning_is_never_a_baseline() -> None:
    """Units dormant from the first epochs' 0.0 to 0.4 by epoch 20 (what learning does at
    the start), flat after: the old rule (median of the first 5 epochs) fired; the
    baselines now start after the first 4 windows, so nothing holds."""
    run = with_series(healthy_run(), DORMANT, lambda e: min(0.02 * (e - 1), 0.4))
    start = statistics.median(r[DORMANT] for r in run[:WINDOW])
    assert rule_named("dormant_units").holds(0.4, start)  # against the start it would fire
    assert diagnose(run) == []


def test_a_jump_is_found_against_the_trailing_window_with_its_onset() -> None:
    run = with_series(healthy_run(), DORMANT, dormant_jump)
    (f,) = diagnose(run)
    assert (f.rule, f.component, f.tier) == ("dormant_units", "actor_mlp.layer_1", "observation")
    # first fired at epoch 48 (3 of its 5 points at 0.4), against epochs 29-33 (15 before)
    assert f.baseline_epochs == [29, 33] and f.baseline == pytest.approx(0.05)
    assert f.onset_epoch == 46  # the first point of that window at 0.4
    assert f.value == pytest.approx(0.4) and f.last_epoch == EPOCHS
    assert f.metric == DORMANT and "redo" in f.remedies and f.docs.endswith("relu.md")


def test_a_fired_rule_holds_against_the_level_before_the_change_until_it_returns() -> None:
    """15 epochs after the jump the trailing window holds 0.4 too: the rule still holds,
    against the frozen 0.05; once the measure is back at 0.05 the rule clears."""
    run = with_series(healthy_run(epochs=90), DORMANT, dormant_jump)
    (f,) = diagnose(run)
    assert (f.onset_epoch, f.baseline_epochs) == (46, [29, 33])
    back = with_series(healthy_run(epochs=90), DORMANT, lambda e: 0.4 if 45 < e <= 70 else 0.05)
    assert diagnose(back[:70])[0].onset_epoch == 46
    assert diagnose(back) == []  # at 90 the last five are 0.05 again


def test_a_slow_drift_is_no_change_over_the_lag() -> None:
    """Weight norm x 1.02 per epoch: 3.3x over 60 epochs, 1.02^15 = 1.35 < 1.5 between a
    window and the one 15 epochs before: no finding; a step x 1.5 is one."""
    key = "probes/weights/actor_mlp.layer_0.linear/norm"
    assert 1.02**15 < 1.5 < 1.02**59
    assert diagnose(with_series(healthy_run(), key, lambda e: 5.0 * 1.02**e)) == []
    (f,) = diagnose(with_series(healthy_run(), key, lambda e: 4.0 if e <= 45 else 6.0))
    assert (f.rule, f.onset_epoch, f.baseline) == ("weight_norm_growth", 46, 4.0)


def test_medians_ignore_an_outlier_in_the_baseline_and_two_in_the_last_window() -> None:
    run = with_series(healthy_run(), DORMANT, dormant_jump)
    run[30][DORMANT] = 0.9  # epoch 31, inside the baseline window 29-33
    (f,) = diagnose(run)
    assert f.baseline == pytest.approx(0.05)
    calm = healthy_run()
    calm[-1][DORMANT] = calm[-3][DORMANT] = 0.9  # two bad epochs of five: no trend
    calm[-1]["probes/churn/policy/policy_kl"] = 0.5
    assert diagnose(calm) == []


def test_the_slope_reads_the_last_two_windows() -> None:
    """Flat, then +0.02 per epoch over the last 10 epochs: the slope is 0.02 exactly
    (least squares over the last 2 x 5 points), not the whole run's."""
    run = with_series(healthy_run(), DORMANT, lambda e: 0.05 if e <= 50 else 0.3 + 0.02 * e)
    (f,) = diagnose(run)
    assert f.slope == pytest.approx(0.02)


def test_a_duplicated_epoch_counts_once_the_last_written() -> None:
    run = with_series(healthy_run(), DORMANT, dormant_jump)
    again = dict(run[49], **{DORMANT: 0.4})
    twice = run[:50] + [dict(run[49], **{DORMANT: 0.01}), again] + run[50:]
    assert [f.to_dict() for f in diagnose(twice)] == [f.to_dict() for f in diagnose(run)]
    # the rewritten epoch's last value counts: 0.01 written last at epoch 50 instead
    rewrite = run[:50] + [dict(run[49], **{DORMANT: 0.01})] + run[50:]
    fixed = [dict(r) for r in run]
    fixed[49][DORMANT] = 0.01
    assert [f.to_dict() for f in diagnose(rewrite)] == [f.to_dict() for f in diagnose(fixed)]


def test_a_live_analysis_rereads_an_epoch_written_again() -> None:
    """A resumed or rewound loop writes epoch 50 again, after 51-53: the live findings
    are those of the run with the last value of every epoch (the engine reads all again)."""
    run = jump_run()
    analysis = LiveAnalysis()
    for r in run[:53] + [dict(run[49], **{DORMANT: 0.02})]:
        analysis.add(Record.from_json(r))
    expected = [dict(r) for r in run[:53]]
    expected[49][DORMANT] = 0.02
    live = [f.to_dict() for f in analysis.findings.findings()]
    assert live == [f.to_dict() for f in diagnose(expected)]
    # the same 53 epochs without the rewrite give other evidence
    assert live != [f.to_dict() for f in diagnose(run[:53])]


def test_a_component_is_reported_under_its_layer_only_while_their_series_are_equal() -> None:
    comp = "probes/relu/actor_mlp/dormant_fraction_ref"
    run = with_series(healthy_run(), DORMANT, dormant_jump)
    for r in run:
        r[comp] = r[DORMANT]
    assert [f.component for f in diagnose(run)] == ["actor_mlp.layer_1"]
    run[-1][comp] = 0.39  # the component's own series now
    assert sorted(f.component for f in diagnose(run)) == ["actor_mlp", "actor_mlp.layer_1"]


def test_a_ratio_from_a_baseline_at_its_floor_divides_by_the_floor() -> None:
    rule = rule_named("churn_rising")
    _, _, needed = sizes(rule)
    floor = rule.floor
    assert rules_found(step_run(rule, 0.0, rule.threshold * floor, needed)) == ["churn_rising"]
    short = math.nextafter(rule.threshold * floor, 0)
    assert rules_found(step_run(rule, 0.0, short, needed)) == []
    falling = rule_named("updates_stalled")  # a falling ratio never holds from its floor
    assert rules_found(step_run(falling, falling.floor, 0.0, needed)) == []


def test_updates_stalled_reads_the_learning_rate() -> None:
    key = "probes/weights/actor_mlp.layer_0.linear/update_ratio"
    annealed = healthy_run()
    for r in annealed:  # lr annealed to a tenth; the update ratio follows it
        r[LR] = 2.5e-4 * (1 - 0.9 * r["epoch"] / EPOCHS)
        r[key] = 40.0 * r[LR]
    assert diagnose(annealed) == []
    low = 0.01 * rule_named("updates_stalled").threshold / 2  # half the threshold's ratio
    stalled = with_series(healthy_run(), key, lambda e: 0.01 if e <= 45 else low)
    (f,) = diagnose(stalled)
    assert (f.rule, f.divide_by, f.onset_epoch) == ("updates_stalled", LR, 46)
    assert f.value == pytest.approx(low / 2.5e-4) and f.baseline == pytest.approx(0.01 / 2.5e-4)
    for r in stalled:
        del r[LR]
    assert diagnose(stalled) == []  # without the learning rate the rule cannot read it


def test_findings_come_before_observations() -> None:
    run = with_series(healthy_run(), DORMANT, dormant_jump)
    with_series(run, "train/value_target_std", lambda e: 3.0 if e <= 45 else 30.0)
    found = diagnose(run)
    assert [(f.tier, f.rule) for f in found] == [
        ("finding", "value_target_scale"),
        ("observation", "dormant_units"),
    ]
    text = render_text(found)
    assert text.startswith("1 finding(s):\n- train/value_target_std:")
    assert text.index("spread grew tenfold") < text.index("1 observation(s): unusual trends")


def write_run(run_dir: Path, records: list[dict], partial: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(lines + partial)


def jump_run() -> list[dict]:
    return with_series(healthy_run(), DORMANT, dormant_jump)


def test_diagnose_json_round_trips_on_a_run_still_training(tmp_path: Path, capsys) -> None:
    run = jump_run()
    # the line the run is writing now: cut off mid-record
    write_run(tmp_path / "run", run, partial='{"epoch": 61, "probes/relu/act')
    assert main(["diagnose", str(tmp_path / "run"), "--json"]) == 0
    printed = capsys.readouterr().out
    found = from_json(printed)
    assert found == diagnose_run(tmp_path / "run") == diagnose(run)
    assert [(f.component, f.onset_epoch) for f in found] == [("actor_mlp.layer_1", 46)]
    assert main(["diagnose", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert text == render_text(found) + "\n"
    assert text.startswith("no findings: no direct test shows a problem\n1 observation(s)")
    assert "actor_mlp.layer_1" in text and "since epoch 46" in text


def test_diagnose_without_metrics_says_what_to_change(tmp_path: Path, capsys) -> None:
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "sinks.jsonl=true" in capsys.readouterr().err


def emit_all(sink, records: list[dict]) -> None:
    """Feed ``records`` to ``sink`` as a session does: through a live analysis, which
    hands the run's findings over with each epoch's record."""
    analysis = LiveAnalysis()
    for rec in records:
        sink.emit(analysis.add(Record.from_json(rec)))


def test_the_console_states_the_findings_when_the_run_ends() -> None:
    from rich.console import Console

    from policy_probes.sinks.console import ConsoleSink

    console = Console(record=True, width=200)
    sink = ConsoleSink(console=console, live=False)
    emit_all(sink, jump_run())
    sink.close()
    out = console.export_text()
    assert render_text(diagnose(jump_run())) in out
    assert "actor_mlp.layer_1: units went dormant on the reference states" in out


def test_the_wandb_run_summary_holds_the_findings(tmp_path: Path) -> None:
    from wandb_reader import run_file, wandb_records

    from policy_probes.sinks.config import WandbConfig
    from policy_probes.sinks.wandb_sink import WandbSink

    run = with_series(jump_run(), "train/value_target_std", lambda e: 3.0 if e <= 45 else 30.0)
    sink = WandbSink(tmp_path, WandbConfig(mode="offline"), {})
    emit_all(sink, run)
    sink.close()
    summary = {}
    for r in wandb_records(run_file(tmp_path)):
        if r.WhichOneof("record_type") == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    want = [f.to_dict() for f in diagnose(run)]
    assert (summary["findings/count"], summary["findings/observations"]) == (1, 1)
    assert summary["findings/list"] == want


def test_report_html_opens_with_the_findings(tmp_path: Path) -> None:
    from policy_probes.analysis.report import build_report

    write_run(tmp_path / "run", jump_run())
    page = build_report(tmp_path / "run").read_text()
    top = page.index('<h2 id="findings">')
    assert top < page.index("<h2>Returns</h2>")
    assert "actor_mlp.layer_1" in page[top:] and "units went dormant" in page
    assert "<td>observation</td>" in page
    write_run(tmp_path / "healthy", healthy_run())
    assert "No findings and no observations" in build_report(tmp_path / "healthy").read_text()
    write_run(tmp_path / "short", healthy_run(epochs=8))  # too short to judge: it says so
    page = build_report(tmp_path / "short").read_text()
    assert "No findings" not in page
    assert "nothing could be judged: the run has 8 epoch records" in page


def rules_afresh(records: list[dict], window: int = WINDOW) -> list[tuple]:
    """The rules computed afresh from every epoch's finite float values, as the docs
    state them, epoch by epoch from the start: the rolling median of the last ``w``
    points against the median of the ``w`` points ending ``lag`` points earlier (none
    before ``skip + w + lag`` points); once it holds, against that baseline until it no
    longer does; the onset is the first point of the window that fired whose own value
    holds. A component whose series equals one of its layers' is left to the layer."""
    table: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("hook_point", "POST_EPOCH") == "POST_EPOCH":
            for k, v in r.items():
                if type(v) is float and math.isfinite(v):
                    table.setdefault(k, {})[r["epoch"]] = v
    found = []
    for rule in default_rules():
        w = rule.window or window
        lag = LAG_WINDOWS * w if rule.lag is None else rule.lag
        based = rule.kind == "ratio" or rule.min_change > 0
        skip = SKIP_WINDOWS * w if rule.skip is None else rule.skip
        needed = skip + w + lag if based else w
        hits = []
        for key in sorted(table):
            component = rule.matches(key)
            if component is None:
                continue
            points = sorted(table[key].items())
            if rule.divide_by is not None:
                lr = table.get(rule.divide_by, {})
                points = [(e, v / lr[e]) for e, v in points if lr.get(e)]
            epochs, values = [e for e, _ in points], [v for _, v in points]
            onset = frozen = None
            for i in range(needed - 1, len(values)):
                rolling = statistics.median(values[i + 1 - w : i + 1])
                if onset is not None:
                    if not rule.holds(rolling, frozen):
                        onset = frozen = None
                    continue
                base = statistics.median(values[i + 1 - lag - w : i + 1 - lag]) if based else None
                if rule.holds(rolling, base):
                    frozen = base
                    onset = next(
                        epochs[j] for j in range(i + 1 - w, i + 1) if rule.holds(values[j], base)
                    )
            if onset is not None:
                hits.append((onset, rule.name, component, key, rolling, epochs[-1]))
        for hit in hits:
            same = [
                h for h in hits if h[2].startswith(hit[2] + ".") and table[h[3]] == table[hit[3]]
            ]
            if not same:
                found.append(hit)
    return sorted(found)


def as_tuples(findings) -> list[tuple]:
    keys = ("onset_epoch", "rule", "component", "metric", "value", "last_epoch")
    return sorted(tuple(f[k] for k in keys) for f in findings)


def test_the_live_findings_are_those_of_the_records_so_far_at_every_epoch() -> None:
    """Epoch by epoch, the findings a session hands its sinks (a live analysis fed one
    record at a time, keeping only 25 epochs per series) are the rules computed afresh on
    the records so far: also with a layer whose probe starts reporting later, values that
    are no numbers (a bool, None), SNAPSHOT records between the epochs, a component
    whose series is its last layer's until it is not, and a rule that fires and clears."""
    records = with_series(healthy_run(epochs=80), DORMANT, lambda e: 0.4 if 45 < e <= 60 else 0.05)
    norm = "probes/weights/actor_mlp/norm"
    for r in records:
        r["probes/relu/actor_mlp/dormant_fraction_ref"] = r[DORMANT]
        r[norm] = r["probes/weights/actor_mlp.layer_1.linear/norm"] = (
            2.0 if r["epoch"] <= 35 else 4.0
        )
    records[-1][norm] = 4.1  # no longer the layer's series
    for r in records[10:]:  # a layer whose probe starts reporting later
        r["probes/relu/critic_mlp.layer_0/dead_fraction_ref"] = 0.0 if r["epoch"] < 55 else 0.5
    records[20]["probes/relu/critic_mlp.layer_0/dead_fraction_ref"] = True  # not a number
    records[21]["probes/relu/critic_mlp.layer_0/dead_fraction_ref"] = None
    analysis = LiveAnalysis(max_epochs=25)
    so_far, seen = [], set()
    for r in records:
        so_far.append(r)
        record = analysis.add(Record.from_json(r))
        assert as_tuples(record.findings) == rules_afresh(so_far), r["epoch"]
        afresh = FindingsEngine()  # what `diagnose` prints for these records
        afresh.update(RunRecords().extend(so_far))
        coverage = afresh.coverage(len(so_far))
        assert record.findings_text == render_text(diagnose(so_far), coverage)
        seen |= {(f["rule"], f["component"]) for f in record.findings}
        snapshot = {"epoch": r["epoch"], "hook_point": "SNAPSHOT", norm: 9.0}
        assert analysis.add(Record.from_json(snapshot)).findings is None
    assert seen >= {
        ("dormant_units", "actor_mlp.layer_1"),  # fired at 48, cleared at 63
        ("weight_norm_growth", "actor_mlp.layer_1.linear"),
        ("weight_norm_growth", "actor_mlp"),  # at the last epoch: its own series now
        ("dead_units", "critic_mlp.layer_0"),
    }
    assert ("dormant_units", "actor_mlp.layer_1") not in {
        (f["rule"], f["component"]) for f in record.findings
    }
    # the store kept 25 epochs of the series the rules read (and the rate), nothing else
    assert set(analysis.records.scalars) == {k for r in records for k in r if analysis.keeps(k)}
    assert LR in analysis.records.scalars
    assert "rollout/episode_return" not in analysis.records.scalars
    assert {len(s) for s in analysis.records.scalars.values()} == {25}


def test_the_findings_of_a_training_run_are_those_of_its_metrics_jsonl(tmp_path: Path) -> None:
    """A real training run: the findings its session handed the W&B sink with its last
    epoch are what ``diagnose`` finds in its metrics.jsonl; and its records, read back
    and fed one at a time with windows short enough for 8 epochs, give at each epoch what
    ``diagnose`` gives on the lines so far and what the rules computed afresh give."""
    from sinks_support import tiny_cartpole
    from wandb_reader import run_file, wandb_records

    from policy_probes.sinks import SinksConfig, WandbConfig

    tool = tiny_cartpole(
        tmp_path,
        epochs=8,
        sinks=SinksConfig(console=False, csv=False, wandb=True),
        wandb=WandbConfig(mode="offline"),
    )
    assert tool.invoke().sink_failures == {}
    summary = {}
    for r in wandb_records(run_file(tmp_path)):
        if r.WhichOneof("record_type") == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    assert summary["findings/list"] == [f.to_dict() for f in diagnose_run(tmp_path)]
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    for window in (1, 2):
        analysis = LiveAnalysis(window=window)
        for i, line in enumerate(lines):
            record = analysis.add(Record.from_json(line))
            expected = [f.to_dict() for f in diagnose(lines[: i + 1], window=window)]
            assert list(record.findings) == expected
            assert as_tuples(expected) == rules_afresh(lines[: i + 1], window)


def test_a_resumed_session_finds_over_the_whole_run(tmp_path: Path) -> None:
    """A session that resumes a run reads its earlier records back: its findings are
    those of the whole metrics.jsonl, the baseline window being before the resume."""
    from torch import nn

    from policy_probes import ProbeSession, ProbeSettings, Run
    from policy_probes.sinks import SinksConfig, WandbConfig

    probing = ProbeSettings(
        sinks=SinksConfig(console=False, csv=False, wandb=False), wandb=WandbConfig(mode="disabled")
    )
    run = jump_run()
    for part, resume in ((run[:47], False), (run[47:], True)):
        with ProbeSession(nn.Linear(2, 2), run=Run(tmp_path, resume=resume), probing=probing) as s:
            for rec in part:
                s.log({k: v for k, v in rec.items() if k not in ("epoch", "hook_point")})
                s.epoch_end(step=rec["agent_step"])
            found = [f.to_dict() for f in s.analysis.findings.findings()]
            assert not s.analysis.with_figures  # no sink draws figures: their series not kept
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 61))
    assert (
        found
        == [f.to_dict() for f in diagnose(run)]
        == [f.to_dict() for f in diagnose_run(tmp_path)]
    )
    assert [(f["component"], f["onset_epoch"]) for f in found] == [("actor_mlp.layer_1", 46)]
