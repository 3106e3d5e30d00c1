"""Findings on constructed runs: a climbing measure yields the finding for its layer with
the epoch it crossed its threshold; a healthy (noisy, flat) run yields none; a single bad
epoch is no trend; ``policy-probes diagnose --json`` round-trips; the findings a session
computes live, epoch by epoch, are those of the records so far."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from policy_probes.analysis.findings import (
    FindingsEngine,
    default_rules,
    diagnose,
    diagnose_run,
    from_json,
    render_text,
)
from policy_probes.analysis.live import LiveAnalysis
from policy_probes.cli import main
from policy_probes.records import Record, RunRecords, read_jsonl

EPOCHS = 30


def healthy_record(epoch: int, rng: random.Random) -> dict:
    """Flat measures with noise, as a run that keeps learning shows them."""
    return {
        "epoch": epoch,
        "hook_point": "POST_EPOCH",
        "agent_step": 512 * epoch,
        "rollout/episode_return": 100 + rng.uniform(-20, 20),
        "probes/relu/actor_mlp.layer_0/dormant_fraction": 0.02 + rng.uniform(-0.015, 0.015),
        "probes/relu/actor_mlp.layer_1/dormant_fraction": 0.03 + rng.uniform(-0.02, 0.02),
        "probes/relu/actor_mlp.layer_0/dead_fraction": 0.0,
        "probes/churn/policy/policy_kl": 1e-3 * (1 + rng.uniform(-0.3, 0.3)),
        "probes/churn/policy/value_change": 0.05 * (1 + rng.uniform(-0.3, 0.3)),
        "probes/weights/actor_mlp.layer_0.linear/norm": 5.0 + 0.01 * epoch,
        "probes/weights/actor_mlp.layer_0.linear/update_ratio": 0.01 * (1 + rng.uniform(-0.2, 0.2)),
        "probes/fisher/actor_mlp/trace": 2.0 * (1 + rng.uniform(-0.4, 0.4)),
        "train/value_target_std": 3.0 * (1 + rng.uniform(-0.1, 0.1)),
    }


def healthy_run(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [healthy_record(e, rng) for e in range(1, EPOCHS + 1)]


def with_climb(records: list[dict], key: str, value_at) -> list[dict]:
    for rec in records:
        rec[key] = value_at(rec["epoch"])
    return records


def dormant_climb(epoch: int) -> float:
    """0.02 until epoch 12, then +0.025 per epoch: 0.095 at epoch 15, 0.12 at epoch 16,
    the first epoch past the rule's 0.1."""
    return 0.02 + 0.025 * max(epoch - 12, 0)


def test_a_healthy_run_yields_no_finding() -> None:
    for seed in range(5):
        assert diagnose(healthy_run(seed)) == [], seed


def test_a_single_bad_epoch_is_not_a_trend() -> None:
    run = healthy_run()
    run[-1]["probes/relu/actor_mlp.layer_0/dormant_fraction"] = 0.6
    run[-3]["probes/relu/actor_mlp.layer_0/dormant_fraction"] = 0.6
    run[-1]["probes/churn/policy/policy_kl"] = 0.5
    assert diagnose(run) == []


def test_a_climbing_dormant_fraction_names_the_layer_and_its_onset() -> None:
    run = with_climb(healthy_run(), "probes/relu/actor_mlp.layer_1/dormant_fraction", dormant_climb)
    # actor_mlp's output is its last layer's: the same series, reported under the layer
    for rec in run:
        rec["probes/relu/actor_mlp/dormant_fraction"] = rec[
            "probes/relu/actor_mlp.layer_1/dormant_fraction"
        ]
    found = diagnose(run)
    assert [(f.rule, f.component) for f in found] == [("dormant_units", "actor_mlp.layer_1")]
    f = found[0]
    first_past = min(e for e in range(1, EPOCHS + 1) if dormant_climb(e) >= 0.1)
    assert f.onset_epoch == first_past == 16
    assert f.metric == "probes/relu/actor_mlp.layer_1/dormant_fraction"
    assert f.value == pytest.approx(dormant_climb(EPOCHS - 2))  # median of the last 5
    assert f.baseline == pytest.approx(0.02)
    assert f.slope == pytest.approx(0.025)
    assert f.threshold == 0.1 and "redo" in f.remedies and f.docs.endswith("relu.md")
    assert f.last_epoch == EPOCHS


def test_a_series_shorter_than_three_windows_yields_no_finding() -> None:
    """The climb of the test above, cut to 14 epochs (fewer than 3 x 5): no finding; the
    same 14 epochs read with a window of 4 (12 epochs needed) are found."""
    run = with_climb(healthy_run(), "probes/relu/actor_mlp.layer_1/dormant_fraction", dormant_climb)
    short = [
        dict(r, **{"probes/relu/actor_mlp.layer_1/dormant_fraction": dormant_climb(r["epoch"] + 8)})
        for r in run[:14]
    ]
    assert diagnose(short) == []
    found = diagnose(short, window=4)
    assert [(f.rule, f.component) for f in found] == [("dormant_units", "actor_mlp.layer_1")]


def test_rising_churn_is_found_with_its_onset() -> None:
    def kl(epoch: int) -> float:  # 1e-3, tripled from epoch 21 on
        return 1e-3 if epoch < 21 else 3e-3

    run = with_climb(healthy_run(1), "probes/churn/policy/policy_kl", kl)
    found = diagnose(run)
    assert [(f.rule, f.component, f.onset_epoch) for f in found] == [("churn_rising", "policy", 21)]
    assert found[0].value / found[0].baseline == pytest.approx(3.0)


def test_a_falling_fisher_trace_is_found() -> None:
    run = with_climb(healthy_run(2), "probes/fisher/actor_mlp/trace", lambda e: 2.0 * 0.8**e)
    found = diagnose(run)
    assert [f.rule for f in found] == ["fisher_collapse"]
    # 0.8^e falls below a tenth of the baseline median (0.8^3) first at e = 14
    assert found[0].onset_epoch == min(e for e in range(1, 31) if 0.8**e <= 0.1 * 0.8**3) == 14


def write_run(run_dir: Path, records: list[dict], partial: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(lines + partial)


def test_diagnose_json_round_trips_on_a_run_still_training(tmp_path: Path, capsys) -> None:
    run = with_climb(healthy_run(), "probes/relu/actor_mlp.layer_0/dormant_fraction", dormant_climb)
    # the line the run is writing now: cut off mid-record
    write_run(tmp_path / "run", run, partial='{"epoch": 31, "probes/relu/act')
    assert main(["diagnose", str(tmp_path / "run"), "--json"]) == 0
    printed = capsys.readouterr().out
    found = from_json(printed)
    assert found == diagnose_run(tmp_path / "run") == diagnose(run)
    assert [(f.component, f.onset_epoch) for f in found] == [("actor_mlp.layer_0", 16)]
    assert main(["diagnose", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert text == render_text(found) + "\n"
    assert "actor_mlp.layer_0" in text and "since epoch 16" in text


def test_diagnose_without_metrics_says_what_to_change(tmp_path: Path, capsys) -> None:
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "sinks.jsonl=true" in capsys.readouterr().err


def climbing_run() -> list[dict]:
    return with_climb(
        healthy_run(), "probes/relu/actor_mlp.layer_0/dormant_fraction", dormant_climb
    )


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
    emit_all(sink, climbing_run())
    sink.close()
    out = console.export_text()
    assert render_text(diagnose(climbing_run())) in out
    assert "actor_mlp.layer_0: dormant units are accumulating" in out


def test_the_wandb_run_summary_holds_the_findings(tmp_path: Path) -> None:
    from wandb_reader import run_file, wandb_records

    from policy_probes.sinks.config import WandbConfig
    from policy_probes.sinks.wandb_sink import WandbSink

    sink = WandbSink(tmp_path, WandbConfig(mode="offline"), {})
    emit_all(sink, climbing_run())
    sink.close()
    summary = {}
    for r in wandb_records(run_file(tmp_path)):
        if r.WhichOneof("record_type") == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    want = [f.to_dict() for f in diagnose(climbing_run())]
    assert summary["findings/count"] == 1
    assert summary["findings/list"] == want


def test_report_html_opens_with_the_findings(tmp_path: Path) -> None:
    from policy_probes.analysis.report import build_report

    write_run(tmp_path / "run", climbing_run())
    page = build_report(tmp_path / "run").read_text()
    top = page.index('<h2 id="findings">')
    assert top < page.index("<h2>Returns</h2>")
    assert "actor_mlp.layer_0" in page[top:] and "dormant units are accumulating" in page
    write_run(tmp_path / "healthy", healthy_run())
    assert "No findings" in build_report(tmp_path / "healthy").read_text()


def rules_afresh(records: list[dict], window: int = 5) -> list[tuple]:
    """The rules computed afresh from every epoch's finite float values, as the docs
    state them: baseline = median of the first ``window`` values, the rolling median at
    the last epoch meets the condition and has since the stretch began, the onset is the
    first epoch of that stretch's first window whose own value meets it; a component
    whose series equals one of its layers' is left to the layer."""
    table: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("hook_point", "POST_EPOCH") == "POST_EPOCH":
            for k, v in r.items():
                if type(v) is float and math.isfinite(v):
                    table.setdefault(k, {})[r["epoch"]] = v
    found = []
    for rule in default_rules():
        hits = []
        for key in sorted(table):
            component, points = rule.matches(key), sorted(table[key].items())
            if component is None or len(points) < 3 * window:
                continue
            epochs, values = [e for e, _ in points], [v for _, v in points]
            base = statistics.median(values[:window])
            rolling = [
                statistics.median(values[i + 1 - window : i + 1])
                for i in range(window - 1, len(values))
            ]
            holds = [rule.holds(m, base) for m in rolling]
            if not holds[-1]:
                continue
            start = len(holds) - 1
            while start and holds[start - 1]:
                start -= 1
            stretch = range(start, start + window)
            onset = next(
                (epochs[i] for i in stretch if rule.holds(values[i], base)), epochs[stretch[-1]]
            )
            hits.append((onset, rule.name, component, key, rolling[-1], base, epochs[-1]))
        for hit in hits:
            layers = [
                h for h in hits if h[2].startswith(hit[2] + ".") and table[h[3]] == table[hit[3]]
            ]
            if not layers:
                found.append(hit)
    return sorted(found)


def as_tuples(findings) -> list[tuple]:
    keys = ("onset_epoch", "rule", "component", "metric", "value", "baseline", "last_epoch")
    return sorted(tuple(f[k] for k in keys) for f in findings)


def test_the_live_findings_are_those_of_the_records_so_far_at_every_epoch() -> None:
    """Epoch by epoch, the findings a session hands its sinks (a live analysis fed one
    record at a time, keeping only 8 epochs per series) are the rules computed afresh on
    the records so far: also with a layer whose probe starts reporting later, values that
    are no numbers (a bool, None), SNAPSHOT records between the epochs and a component
    whose series is its last layer's until it is not."""
    records = climbing_run()
    for r in records:
        r["probes/relu/actor_mlp/dormant_fraction"] = r[
            "probes/relu/actor_mlp.layer_0/dormant_fraction"
        ]
        r["probes/fisher/actor_mlp/trace"] = 2.0 * 0.85 ** r["epoch"]
        r["probes/fisher/actor_mlp.layer_1/trace"] = 2.0 * 0.85 ** r["epoch"]
    records[-1]["probes/fisher/actor_mlp/trace"] = 1e-3  # no longer the layer's series
    for r in records[10:]:  # a layer whose probe starts reporting later
        r["probes/relu/critic_mlp.layer_0/dormant_fraction"] = 0.01 * r["epoch"]
        r["probes/relu/critic_mlp.layer_0/dead_fraction"] = 0.005 * r["epoch"]
    records[20]["probes/relu/critic_mlp.layer_0/dead_fraction"] = True  # not a number
    records[21]["probes/relu/critic_mlp.layer_0/dead_fraction"] = None
    analysis = LiveAnalysis(max_epochs=8)
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
        snapshot = {
            "epoch": r["epoch"],
            "hook_point": "SNAPSHOT",
            "probes/fisher/actor_mlp/trace": 9.0,
        }
        assert analysis.add(Record.from_json(snapshot)).findings is None
    assert seen >= {
        ("dormant_units", "actor_mlp.layer_0"),
        ("fisher_collapse", "actor_mlp.layer_1"),
        ("fisher_collapse", "actor_mlp"),  # at the last epoch: its own series now
        ("dead_units", "critic_mlp.layer_0"),
    }
    # the store kept 8 epochs of the series the rules read, nothing else
    assert set(analysis.records.scalars) == {k for r in records for k in r if analysis.keeps(k)}
    assert "rollout/episode_return" not in analysis.records.scalars
    assert {len(s) for s in analysis.records.scalars.values()} == {8}


def test_the_findings_of_a_training_run_are_those_of_its_metrics_jsonl(tmp_path: Path) -> None:
    """A real training run: the findings its session handed the W&B sink with its last
    epoch are what ``diagnose`` finds in its metrics.jsonl; and its records, read back
    and fed one at a time with windows short enough for 8 epochs, give at each epoch what
    ``diagnose`` gives on the lines so far."""
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
    found = 0
    for window in (1, 2):
        analysis = LiveAnalysis(window=window)
        for i, line in enumerate(lines):
            record = analysis.add(Record.from_json(line))
            expected = [f.to_dict() for f in diagnose(lines[: i + 1], window=window)]
            assert list(record.findings) == expected
            assert as_tuples(expected) == rules_afresh(lines[: i + 1], window)
            found += len(expected)
    assert found  # the comparisons held findings, not only empty lists


def test_a_resumed_session_finds_over_the_whole_run(tmp_path: Path) -> None:
    """A session that resumes a run reads its earlier records back: its findings are
    those of the whole metrics.jsonl, the climb having started before the resume."""
    from torch import nn

    from policy_probes import ProbeSession, ProbeSettings, Run
    from policy_probes.sinks import SinksConfig, WandbConfig

    probing = ProbeSettings(
        sinks=SinksConfig(console=False, csv=False, wandb=False), wandb=WandbConfig(mode="disabled")
    )
    run = climbing_run()
    for part, resume in ((run[:20], False), (run[20:], True)):
        with ProbeSession(nn.Linear(2, 2), run=Run(tmp_path, resume=resume), probing=probing) as s:
            for rec in part:
                s.log({k: v for k, v in rec.items() if k not in ("epoch", "hook_point")})
                s.epoch_end(step=rec["agent_step"])
            found = [f.to_dict() for f in s.analysis.findings.findings()]
            assert not s.analysis.with_figures  # no sink draws figures: their series not kept
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 31))
    assert (
        found
        == [f.to_dict() for f in diagnose(run)]
        == [f.to_dict() for f in diagnose_run(tmp_path)]
    )
    assert [(f["component"], f["onset_epoch"]) for f in found] == [("actor_mlp.layer_0", 16)]
