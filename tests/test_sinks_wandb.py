"""WandbSink: a real offline W&B run, read back from its run file with wandb's protobuf
classes (no network, no mock of wandb)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sinks_support import DEAD_UNITS, emit_probe_run, files_under, tiny_cartpole
from wandb_reader import history_rows, run_file, wandb_records

from policy_probes.analysis.heatmaps import render_heatmaps
from policy_probes.records import Record, RunRecords, read_jsonl
from policy_probes.sinks import (
    JSONLSink,
    SinkGroup,
    SinksConfig,
    WandbConfig,
    WandbSink,
)
from policy_probes.sinks.config import api_key_configured
from policy_probes.sinks.wandb_sink import RUN_ID_FILE, redact_secrets


def test_offline_run_holds_dead_relu_and_fisher_series_histograms_heatmaps_and_config(tmp_path):
    config = {"trainer": {"lr": 2.5e-4, "num_envs": 4}, "seed": 3}
    cfg = WandbConfig(
        mode="offline",
        project="pp-test",
        group="seeds",
        tags=["a", "b"],
        name="probe-run",
        histogram_every=1,  # every epoch's vectors as histograms (the default cadence: below)
    )
    group = SinkGroup([JSONLSink(tmp_path), WandbSink(tmp_path, cfg, config)])
    emit_probe_run(group, epochs=3, snapshot_every=3)
    group.close()
    assert group.failures == {}

    jsonl = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in jsonl] == [0, 1, 2]
    records = wandb_records(run_file(tmp_path))
    rows = [row for row in history_rows(records) if "probes/fisher/actor_mlp/trace" in row]
    assert len(rows) == 3

    series = [
        "probes/relu/actor_mlp/dead_fraction",
        "probes/relu/actor_mlp.layer_0/dead_fraction",
        "probes/relu/actor_mlp.layer_1/dead_fraction",  # per layer of actor_mlp
        "probes/gradient_flow/actor_mlp.layer_0/mean",
        "probes/gradient_flow/actor_mlp.layer_1/blocked_fraction",
        "probes/relu/actor_mlp/dormant_fraction",
        "probes/relu/actor_mlp/zero_fraction",
        "probes/saturation_tanh/critic_mlp/saturated_fraction",
        "probes/fisher/actor_mlp/trace",
        "probes/fisher/actor_mlp/mean",
        "probes/fisher/actor_mlp/max",
        "probes/fisher/actor_mlp/dead_param_fraction",
        "probes/gradient_flow/actor_mlp/mean",
        "probes/gradient_flow/actor_mlp/blocked_fraction",
        "train/policy_loss",
    ]
    for rec, row in zip(jsonl, rows, strict=True):
        assert row["epoch"] == rec["epoch"]
        assert row["agent_step"] == rec["agent_step"] == 128 * (rec["epoch"] + 1)
        for key in series:
            assert row[key] == rec[key], key
        # the forced-dead units of layer_0 show in the series
        assert rec["probes/relu/actor_mlp.layer_0/dead_fraction"] >= len(DEAD_UNITS) / 12
        for key in (
            "probes/relu/actor_mlp/active_rate",
            "probes/fisher/actor_mlp/unit",
            "probes/gradient_flow/actor_mlp/rms",
            "probes/saturation_tanh/critic_mlp/saturation_rate",
        ):
            assert row[f"{key}/_type"] == "histogram"
            expected, edges = np.histogram(np.array(rec[key]), bins=64)
            assert row[f"{key}/values"] == expected.tolist(), key
            np.testing.assert_allclose(row[f"{key}/bins"], edges, rtol=1e-6, atol=1e-12)
        # never one series per unit
        assert not any(k.startswith("probes/relu/actor_mlp/active_rate/0") for k in row)

    # SNAPSHOT at the last epoch: one heatmap image per component and per-unit metric
    images = [row for row in history_rows(records) if any(k.startswith("heatmaps/") for k in row)]
    assert len(images) == 1 and images[0]["epoch"] == 2
    for key in (
        "heatmaps/relu/actor_mlp/active_rate",
        "heatmaps/relu/actor_mlp.layer_0/active_rate",
        "heatmaps/fisher/actor_mlp/unit",
        "heatmaps/gradient_flow/actor_mlp/rms",
        "layers/relu/actor_mlp",  # one line per layer: dead and dormant fractions
        "layers/gradients/actor_mlp",
    ):
        assert images[0][f"{key}/_type"] == "image-file"
        png = run_file(tmp_path).parent / "files" / images[0][f"{key}/path"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert images[0]["layers/saturation/critic_mlp/_type"] == "image-file"  # its tanh layer
    assert not [k for k in images[0] if k.startswith("layers/fisher")]  # fisher: per parameter
    # each image file is its own drawing: the heatmaps are exactly what render_heatmaps
    # draws from the vectors of metrics.jsonl (equal histories share a drawing), and no
    # layer figure repeats another image
    files = run_file(tmp_path).parent / "files"
    stored = {
        k.removesuffix("/path"): (files / v).read_bytes()
        for k, v in images[0].items()
        if k.endswith("/path")
    }
    drawn = render_heatmaps(RunRecords.read(tmp_path))
    assert {k for k in stored if k.startswith("heatmaps/")} == set(drawn)
    for key, (png, _) in drawn.items():
        assert stored[key] == png, key
    layer_images = [png for k, png in stored.items() if k.startswith("layers/")]
    assert len(set(layer_images)) == len(layer_images) >= 3
    assert not set(layer_images) & {png for png, _ in drawn.values()}

    # config, group, tags, name; epoch is the step axis of every metric
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    stored = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert stored["trainer"] == config["trainer"] and stored["seed"] == 3
    assert (run.project, run.run_group, list(run.tags), run.display_name) == (
        "pp-test",
        "seeds",
        ["a", "b"],
        "probe-run",
    )
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "epoch" for m in metrics)
    assert {m.name for m in metrics} >= {"epoch", "agent_step"}


@pytest.mark.parametrize("epochs", [5, 4])
def test_histograms_every_n_epochs_and_the_last_epochs_at_close(tmp_path, epochs):
    """``histogram_every=2``: per-unit vectors become histograms in epochs 0, 2, 4, ...;
    scalars are logged every epoch; a last epoch off the cadence (3 of 0-3) gets its
    histograms in the row the sink logs when it closes."""
    rng = np.random.default_rng(0)
    vectors = {e: rng.random(16).tolist() for e in range(epochs)}
    sink = WandbSink(tmp_path, WandbConfig(mode="offline", histogram_every=2), {})
    for e in range(epochs):
        sink.emit(
            Record.of(
                {"train/x": float(e), "probes/relu/c/active_rate": vectors[e]}, e, "POST_EPOCH"
            )
        )
    sink.close()
    rows = history_rows(wandb_records(run_file(tmp_path)))
    assert [row["train/x"] for row in rows if "train/x" in row] == [float(e) for e in range(epochs)]
    key = "probes/relu/c/active_rate"
    logged = {row["epoch"]: row for row in rows if f"{key}/_type" in row}
    assert sorted(logged) == sorted({e for e in range(epochs) if e % 2 == 0} | {epochs - 1})
    for e, row in logged.items():
        expected, edges = np.histogram(np.array(vectors[e]), bins=64)
        assert row[f"{key}/values"] == expected.tolist(), e
        np.testing.assert_allclose(row[f"{key}/bins"], edges, rtol=1e-6, atol=1e-12)
    if (epochs - 1) % 2:  # the close row: the last epoch's histograms, no scalars again
        closing = rows[-1]
        assert closing["epoch"] == epochs - 1 and "train/x" not in closing
        assert f"{key}/_type" in closing


def test_api_key_never_reaches_run_files(tmp_path, monkeypatch):
    secret = "local-" + "0123456789abcdef" * 3
    monkeypatch.setenv("WANDB_API_KEY", secret)
    config = {"wandb": {"api_key": secret}, "notes": f"key={secret}", "tokens": [1, 2]}
    sink = WandbSink(tmp_path, WandbConfig(mode="offline"), config)
    emit_probe_run(sink, epochs=1)
    sink.close()
    files = files_under(tmp_path)
    assert any(p.suffix == ".wandb" for p in files)
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    assert redact_secrets(config) == {
        "wandb": {"api_key": "<redacted>"},
        "notes": "key=<redacted>",
        "tokens": "<redacted>",
    }


def test_resume_reuses_the_stored_run_id(tmp_path):
    first = WandbSink(tmp_path, WandbConfig(mode="offline"), {})
    first.emit(Record.of({"train/x": 1.0}, 0, "POST_EPOCH"))
    first.close()
    second = WandbSink(tmp_path, WandbConfig(mode="offline"), {})
    second.emit(Record.of({"train/x": 2.0}, 1, "POST_EPOCH"))
    second.close()
    stored = (tmp_path / "wandb" / RUN_ID_FILE).read_text().strip()
    assert first.run_id == second.run_id == stored
    run_files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert {p.name for p in run_files} == {f"run-{stored}.wandb"}


def test_mode_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not api_key_configured()
    assert WandbConfig().resolved_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / "netrc").chmod(0o600)
    assert WandbConfig().resolved_mode() == "online"
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert WandbConfig().resolved_mode() == "online"
    assert WandbConfig(mode="disabled").resolved_mode() == "disabled"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert WandbConfig().resolved_mode() == "offline"
    with pytest.raises(ValueError, match="mode"):
        WandbConfig(mode="sometimes")
    with pytest.raises(ValueError, match="projct"):
        WandbConfig(projct="x")


def test_short_training_run_writes_an_offline_run_matching_metrics_jsonl(tmp_path):
    tool = tiny_cartpole(
        tmp_path,
        epochs=3,
        sinks=SinksConfig(console=False, csv=False, wandb=True),
        wandb=WandbConfig(mode="offline", project="pp-e2e", group="cartpole"),
    )
    result = tool.invoke()
    assert result.sink_failures == {}
    jsonl = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert len(jsonl) == 3
    records = wandb_records(run_file(tmp_path))
    rows = {row["epoch"]: row for row in history_rows(records) if "train/value_loss" in row}
    assert sorted(rows) == [r["epoch"] for r in jsonl]
    for rec in jsonl:
        row = rows[rec["epoch"]]
        assert row["agent_step"] == rec["agent_step"]
        for comp in ("actor_mlp", "critic_mlp"):
            for key in (
                f"probes/relu/{comp}/dead_fraction",
                f"probes/relu/{comp}/dormant_fraction",
                f"probes/fisher/{comp}/trace",
                f"probes/fisher/{comp}/dead_param_fraction",
                f"probes/gradient_flow/{comp}/mean",
            ):
                assert row[key] == rec[key], key
            # histograms every histogram_every=10 epochs: none in epochs 1-3 ...
            assert rec["epoch"] % 10 != 0
            for key in (f"probes/relu/{comp}/active_rate", f"probes/fisher/{comp}/unit"):
                assert f"{key}/_type" not in row, key
        assert row["train/value_loss"] == rec["train/value_loss"]
    # ... and the last epoch's when the run closes, in one row with the heatmaps
    last = [
        row for row in history_rows(records) if "probes/relu/actor_mlp/active_rate/_type" in row
    ]
    assert [row["epoch"] for row in last] == [jsonl[-1]["epoch"]]
    for comp in ("actor_mlp", "critic_mlp"):
        for key in (f"probes/relu/{comp}/active_rate", f"probes/fisher/{comp}/unit"):
            assert last[0][f"{key}/_type"] == "histogram"
            expected, _ = np.histogram(np.array(jsonl[-1][key]), bins=64)
            assert last[0][f"{key}/values"] == expected.tolist(), key
    # heatmaps are logged when the run closes (this trainer emits no SNAPSHOT yet)
    heat = [
        row for row in history_rows(records) if "heatmaps/relu/actor_mlp/active_rate/_type" in row
    ]
    assert len(heat) == 1 and heat[0]["epoch"] == jsonl[-1]["epoch"]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    stored = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert stored["train_tool"]["trainer"]["total_timesteps"] == 512 * 3
    assert stored["train_tool"]["wandb"]["project"] == "pp-e2e" and run.run_group == "cartpole"


def _emit_records(group: SinkGroup, records: list[tuple[int, str]]) -> None:
    for epoch, hook_point in records:
        value = float(epoch) if hook_point == "POST_EPOCH" else -float(epoch)
        group.emit(Record.of({f"x/{hook_point.lower()}": value}, epoch, hook_point, 100 * epoch))


@pytest.mark.parametrize(
    ("held", "checkpoint"),
    [
        (3, 2),  # W&B lost epoch 2's second record and all of epoch 3: backfill, then new
        (5, 2),  # W&B holds epoch 3's first record beyond the checkpoint: skip just that one
        (6, 3),  # W&B holds everything up to the checkpoint: nothing backfilled or skipped
    ],
)
def test_resume_lines_wandb_up_with_jsonl_by_records_not_epochs(tmp_path, held, checkpoint):
    """A kill can leave W&B holding an epoch in part (its first hook point's row). The
    resumed run must log every record once, in order, on one increasing step axis."""
    cfg = WandbConfig(mode="offline", project="pp-resume")
    sequence = [(e, hp) for e in (1, 2, 3, 4) for hp in ("PRE_STEP", "POST_EPOCH")]
    # the killed process: metrics.jsonl got 6 records, W&B only the first `held`
    jsonl = JSONLSink(tmp_path)
    for epoch, hook_point in sequence[:6]:
        jsonl.emit(Record.of({f"x/{hook_point.lower()}": 0.0}, epoch, hook_point))
    jsonl.close()
    first = WandbSink(tmp_path, cfg)
    _emit_records(SinkGroup([first]), sequence[:held])
    first.close()
    # the resumed process: rewound to the checkpoint, then it emits what follows it
    group = SinkGroup([JSONLSink(tmp_path), WandbSink(tmp_path, cfg)])
    for sink in group:
        sink.rewind(checkpoint)
    done = sum(1 for epoch, _ in sequence if epoch <= checkpoint)
    _emit_records(group, sequence[done:])
    group.close()
    rows = [
        row
        for f in sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
        for row in history_rows(wandb_records(f))
    ]
    got = [
        (row["epoch"], "POST_EPOCH" if "x/post_epoch" in row else "PRE_STEP")
        for row in rows
        if "x/post_epoch" in row or "x/pre_step" in row
    ]
    assert got == sequence
    assert [row["_step"] for row in rows] == list(range(len(rows)))


def test_figures_every_heatmap_every_epochs_are_those_of_the_epochs_so_far(tmp_path):
    """``heatmap_every=2``: the sink asks for the figures at the epoch records of epochs
    0 and 2 and at close (epoch 3); each row's heatmaps are exactly what render_heatmaps
    draws from the vectors of metrics.jsonl up to that epoch."""
    cfg = WandbConfig(mode="offline", heatmap_every=2)
    group = SinkGroup([JSONLSink(tmp_path), WandbSink(tmp_path, cfg)])
    emit_probe_run(group, epochs=4)
    group.close()
    assert group.failures == {}
    rows = history_rows(wandb_records(run_file(tmp_path)))
    images = [row for row in rows if "heatmaps/fisher/actor_mlp/unit/path" in row]
    assert [row["epoch"] for row in images] == [0, 2, 3]
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    files = run_file(tmp_path).parent / "files"
    for row in images:
        drawn = render_heatmaps(RunRecords().extend(lines[: row["epoch"] + 1]))
        for key, (png, caption) in drawn.items():
            assert (files / row[f"{key}/path"]).read_bytes() == png, (row["epoch"], key)
            assert row[f"{key}/caption"] == caption
        assert {k.removesuffix("/_type") for k in row if k.startswith("layers/")} >= {
            "layers/relu/actor_mlp",
            "layers/gradients/actor_mlp",
        }
