"""render_heatmaps: the heatmaps the W&B and TensorBoard sinks log, drawn on reused
figures and once for equal histories, pixel for pixel what a fresh figure of each gives."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from policy_probes.analysis.heatmaps import (
    figure_png,
    heatmap_figure,
    heatmap_spec,
    render_heatmaps,
    units_by_epochs,
)
from policy_probes.records import Record, RunRecords


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_each_heatmap_is_what_a_fresh_figure_draws_and_equal_histories_are_drawn_once():
    rng = np.random.default_rng(0)
    records = RunRecords()
    vectors = {
        "relu/actor/active_rate": [rng.random(8) for _ in range(6)],
        "relu/critic/active_rate": [rng.random(8) ** 3 for _ in range(6)],
        "fisher/actor/unit": [rng.random(8) * 1e-3 for _ in range(6)],
        "fisher/critic/unit": [rng.random(8) * 10.0 for _ in range(6)],  # another log range
        "gradient_flow/actor/rms": [rng.random(8) for _ in range(6)],
    }
    vectors["relu/critic/active_rate"][-1][:3] = 0.0  # dead units: drawn in red, counted
    vectors["fisher/critic/unit"][2][4] = np.nan  # a missing value: grey
    # a component's output is its last layer's: the same history under two keys
    vectors["relu/actor.layer_1/active_rate"] = vectors["relu/actor/active_rate"]
    for epoch in range(1, 7):
        metrics = {f"probes/{key}": rows[epoch - 1].tolist() for key, rows in vectors.items()}
        records.add(Record.of(metrics, epoch))

    out = render_heatmaps(records)

    assert set(out) == {f"heatmaps/{key}" for key in vectors}
    shared = out["heatmaps/relu/actor/active_rate"][0]
    assert out["heatmaps/relu/actor.layer_1/active_rate"][0] is shared  # drawn once
    for key in vectors:
        matrix, epochs = units_by_epochs((e, vectors[key][e - 1].tolist()) for e in range(1, 7))
        name = "actor = actor.layer_1" if key.startswith("relu/actor") else key.split("/")[1]
        spec = heatmap_spec(f"probes/{key}")
        fresh = figure_png(heatmap_figure(matrix, epochs, spec, name))
        np.testing.assert_array_equal(pixels(out[f"heatmaps/{key}"][0]), pixels(fresh), key)
        caption = out[f"heatmaps/{key}"][1]
        assert caption == f"{spec.title}, {key.split('/')[1]}, epochs 1-6"
