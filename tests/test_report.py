"""The local report: built from a real training run's metrics.jsonl, self-contained,
holding its figures; heatmaps show the dead units."""

from __future__ import annotations

import argparse
import base64
import io
import re

import numpy as np
import pytest
from matplotlib.image import AxesImage
from PIL import Image
from sinks_support import DEAD_UNITS, emit_probe_run, tiny_cartpole

from policy_probes.analysis.layer_figures import PROBE_SECTIONS, layer_figures, layer_groups
from policy_probes.analysis.report import (
    REPORT_HTML,
    add_report_subcommand,
    build_report,
    heatmap_figures,
    probe_figure,
)
from policy_probes.probes.saturation import attach_saturated_activation_hooks
from policy_probes.records import Record, RunRecords, read_jsonl
from policy_probes.sinks import JSONLSink, SinksConfig

IMG = re.compile(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]+)">')


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    tool = tiny_cartpole(path, epochs=3, sinks=SinksConfig(console=False, csv=False, wandb=False))
    # the ReLU recipe has no saturation probe; one here (its |h| > 0.95 count read on ReLU
    # outputs) gives the report its saturation figure to draw
    tool.add_training_hook("critic_mlp", attach_saturated_activation_hooks("tanh"))
    tool.invoke()
    return path


def test_report_of_a_real_run_holds_its_figures(run_dir):
    out = build_report(run_dir)
    assert out == run_dir / REPORT_HTML
    page = out.read_text()
    images = IMG.findall(page)
    alts = [alt for alt, _ in images]
    for section in (
        "episode return per epoch",
        "losses per epoch",
        "Dead and dormant ReLU units",
        "Saturated activations",
        "Fisher information",
        "Gradient flow",
    ):
        assert section in alts, section
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    per_unit = sorted(
        k
        for k in records[-1]
        if k.startswith("probes/")
        and k.split("/")[1] in ("relu", "fisher", "gradient_flow")
        and k.split("/")[-1] in ("active_rate", "unit", "rms")
    )
    assert sorted(alt for alt in alts if alt.startswith("probes/")) == per_unit
    # actor_mlp and critic_mlp: fisher per unit, and relu active rate and gradient RMS of
    # the component and of each of its two layers (per_layer=True)
    assert len(per_unit) == 14
    for _, data in images:
        png = Image.open(io.BytesIO(base64.b64decode(data)))
        assert png.format == "PNG" and png.width >= 500 and png.height >= 200
    # self-contained: nothing loaded from elsewhere
    assert not re.search(r'(src|href)="(?!data:)', page)
    # the scalar table holds the last value of each metric
    last = records[-1]
    row = re.search(r"<tr><td>train/value_loss</td><td>([^<]+)</td>", page)
    assert row is not None and float(row.group(1)) == pytest.approx(
        last["train/value_loss"], rel=1e-3
    )
    assert f"epochs {records[0]['epoch']}-{last['epoch']} (3)" in page
    # per layer: a section per probe, one figure per component, after the per-component ones
    for section in ("Dead and dormant ReLU units", "Gradient flow"):
        slug = "relu" if section.startswith("Dead") else "gradients"
        assert f'<h2 id="{slug}-layers">{section} per layer</h2>' in page
        for component in ("actor_mlp", "critic_mlp"):
            assert f"{section} per layer: {component}" in alts
    assert page.index('id="relu"') < page.index('id="relu-layers"') < page.index('id="heatmaps"')
    assert "configuration" in page  # config.json of the run


def test_heatmap_marks_dead_units_red(tmp_path):
    sink = JSONLSink(tmp_path)
    emit_probe_run(sink, epochs=3)
    sink.close()
    figures = dict(heatmap_figures(RunRecords.read(tmp_path)))
    fig = figures["probes/relu/actor_mlp.layer_0/active_rate"]
    (image,) = [a for a in fig.axes[0].get_children() if isinstance(a, AxesImage)]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    expected = np.array([r["probes/relu/actor_mlp.layer_0/active_rate"] for r in records]).T
    np.testing.assert_array_equal(np.asarray(image.get_array()), expected)
    rgba = image.to_rgba(image.get_array())
    red = np.all(rgba == (1.0, 0.0, 0.0, 1.0), axis=-1)
    assert red.all(axis=1)[list(DEAD_UNITS)].all()
    assert np.array_equal(red, expected == 0)


def test_report_subcommand_and_missing_metrics(run_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_report_subcommand(parser.add_subparsers(dest="command"))
    out = tmp_path / "elsewhere" / "r.html"
    args = parser.parse_args(["report", str(run_dir), "--out", str(out)])
    assert args.handler(args) == 0
    assert out.is_file() and str(out) in capsys.readouterr().out
    args = parser.parse_args(["report", str(tmp_path / "empty")])
    assert args.handler(args) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_report_of_a_run_without_probes_says_what_is_missing(tmp_path):
    sink = JSONLSink(tmp_path)
    for epoch in range(3):
        metrics = {"rollout/episode_return": float(epoch), "train/value_loss": None}
        sink.emit(Record.of(metrics, epoch, "POST_EPOCH", 100 * (epoch + 1)))
    sink.close()
    page = build_report(tmp_path).read_text()
    assert [alt for alt, _ in IMG.findall(page)] == ["episode return per epoch", "losses per epoch"]
    assert "Not recorded in this run:" in page and "per-unit heatmaps" in page
    assert "300 environment steps" in page


def test_per_layer_figures_draw_each_layer_series_and_component_figures_leave_layers_out(
    run_dir,
):
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    run = RunRecords.read(run_dir)
    figures = {(slug, comp): fig for slug, comp, fig in layer_figures(run)}
    fig = figures[("relu", "actor_mlp")]
    dead, dormant = fig.axes[0], fig.axes[1]
    assert dead.get_title() == "dead fraction (active rate 0): actor_mlp"
    assert [line.get_label() for line in dead.get_lines()] == ["layer_0", "layer_1"]
    for ax, metric in ((dead, "dead_fraction"), (dormant, "dormant_fraction")):
        for line in ax.get_lines():
            key = f"probes/relu/actor_mlp.{line.get_label()}/{metric}"
            assert list(line.get_xdata()) == [r["epoch"] for r in records]
            np.testing.assert_array_equal(line.get_ydata(), [r[key] for r in records])
    # the per-component figure: one line per component, its layers are drawn per layer
    per_component = probe_figure(run, PROBE_SECTIONS[0][2])
    assert [line.get_label() for line in per_component.axes[0].get_lines()] == [
        "actor_mlp",
        "critic_mlp",
    ]


def test_layer_groups_nest_names_under_the_longest_recorded_prefix():
    names = ["trunk", "trunk.0.1", "trunk.0.3", "trunk.2", "enc", "enc.10", "enc.9", "head"]
    assert layer_groups(names) == {
        "enc": ["enc.9", "enc.10"],
        "trunk": ["trunk.0.1", "trunk.0.3", "trunk.2"],
    }
    assert layer_groups(["actor_mlp.layer_0", "actor_mlp.layer_1"]) == {}  # no parent recorded
