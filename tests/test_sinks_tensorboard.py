"""TensorBoardSink: event files read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import numpy as np
import pytest
from sinks_support import emit_probe_run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from policy_probes.sinks import SinkGroup, SinksConfig, TensorBoardSink, WandbConfig, build_sinks


def test_scalars_histograms_and_heatmaps_read_back(tmp_path):
    group = SinkGroup([TensorBoardSink(tmp_path)])  # it asks for the figures at SNAPSHOT
    emitted = emit_probe_run(group, epochs=3, snapshot_every=3)
    group.close()
    assert group.failures == {}
    acc = EventAccumulator(
        str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "images": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    for key in (
        "probes/relu/actor_mlp/dead_fraction",
        "probes/fisher/actor_mlp/trace",
        "train/policy_loss",
    ):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [step for _, step, _ in emitted]
        # TensorBoard stores float32
        np.testing.assert_allclose(
            [e.value for e in events], [m[key] for _, _, m in emitted], rtol=1e-6
        )
    assert [e.value for e in acc.Scalars("epoch")] == [0, 1, 2, 2]  # POST_EPOCH x3 + SNAPSHOT
    key = "probes/relu/actor_mlp.layer_0/active_rate"
    hists = acc.Histograms(key)
    assert len(hists) == 3
    for h, (_, _, m) in zip(hists, emitted, strict=True):
        values = m[key]
        assert h.histogram_value.num == len(values)
        assert h.histogram_value.min == pytest.approx(min(values))
        assert h.histogram_value.max == pytest.approx(max(values))
        assert h.histogram_value.sum == pytest.approx(sum(values), rel=1e-6)
    images = [t for t in tags["images"] if t.startswith("heatmaps/")]
    assert sorted(images) == sorted(
        [
            "heatmaps/relu/actor_mlp/active_rate",
            "heatmaps/relu/actor_mlp.layer_0/active_rate",
            "heatmaps/relu/actor_mlp.layer_1/active_rate",  # per layer of actor_mlp
            "heatmaps/fisher/actor_mlp/unit",
            "heatmaps/gradient_flow/actor_mlp/rms",
            "heatmaps/gradient_flow/actor_mlp.layer_0/rms",
            "heatmaps/gradient_flow/actor_mlp.layer_1/rms",
        ]
    )
    # and the per-layer figures: actor_mlp's two ReLU layers, dead and blocked units
    assert {"layers/relu/actor_mlp", "layers/gradients/actor_mlp"} <= set(tags["images"])
    (img,) = acc.Images("heatmaps/fisher/actor_mlp/unit")
    assert (
        img.step == emitted[-1][1]
        and img.width >= 500
        and img.encoded_image_string[:4] == b"\x89PNG"
    )


def test_build_sinks_creates_tensorboard_on_request(tmp_path):
    sinks = build_sinks(
        tmp_path,
        SinksConfig(console=False, jsonl=False, csv=False, wandb=False, tensorboard=True),
        WandbConfig(),
        {},
    )
    assert [s.name for s in sinks] == ["tensorboard"]
    sinks[0].close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
