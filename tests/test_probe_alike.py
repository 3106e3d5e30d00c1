"""Alike streams reduced as one (ProbeState.batch_units): a probe's equally wide layers,
shown the same pushes, are reduced side by side in one set of kernels and summarised at
once; every stream's metrics are what it gets reduced on its own (byte for byte where the
layers' widths are multiples of the vector width, as the built-in policies' are), and
what an independent computation gives. Windows drained in parts, a checkpoint taken
mid-window, a lost stream and a stream that is not alike keep their own numbers."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from policy_probes.probes import FisherInformation, GradientFlow, ReLUActivation, ReLUGradientFlow

torch.set_num_threads(1)

NAMES = ("a.layer_0", "a.layer_1", "b.layer_0", "b.layer_1")


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    x[x.abs() < 0.4] = 0.0  # exact zeros: inactive units and blocked gradients
    return x


def pushes(width: int, passes: int = 3, n: int = 16) -> dict[str, list[torch.Tensor]]:
    return {
        name: [rows(n, width, 100 * i + p) for p in range(passes)] for i, name in enumerate(NAMES)
    }


def fed(tracker, data: dict[str, list[torch.Tensor]], *, batch: bool = True):
    """``tracker`` shown every stream's pushes, pass by pass as a backward pass delivers
    them (``batch=False``: each stream reduced on its own)."""
    tracker.batch_units = batch
    passes = len(next(iter(data.values())))
    if isinstance(tracker, ReLUGradientFlow):
        for component in ("a", "b"):
            tracker.register_component(component)
    else:
        for name in data:
            tracker.register_component(name)
    for p in range(passes):
        for name, blocks in data.items():
            if isinstance(tracker, ReLUGradientFlow):
                component, layer = name.split(".")
                out = blocks[p].clamp(min=0)  # a ReLU's output
                tracker.update(component, layer, blocks[p].flip(0), out)
            else:
                tracker.update(name, blocks[p])
    return tracker


PROBES = [ReLUActivation, GradientFlow, ReLUGradientFlow]


@pytest.mark.parametrize("probe", PROBES)
def test_alike_streams_are_reduced_as_one_with_each_streams_own_numbers(probe) -> None:
    data = pushes(64)
    together = fed(probe(), data)
    together.flush()
    (members,) = together.alike  # one group: every stream
    assert len(members) == 4
    apart = fed(probe(), data, batch=False)
    assert together.to_metrics() == apart.to_metrics()  # byte for byte
    assert not apart.alike


@pytest.mark.parametrize("probe", PROBES)
def test_widths_off_the_vector_width_are_equal_to_float32_rounding(probe) -> None:
    data = pushes(5)
    together, apart = fed(probe(), data).to_metrics(), fed(probe(), data, batch=False).to_metrics()
    assert together.keys() == apart.keys()
    for key, value in together.items():
        assert value == pytest.approx(apart[key], rel=1e-6, abs=1e-12), key


def test_the_numbers_are_the_definitions() -> None:
    data = pushes(64)
    relu = fed(ReLUActivation(), data).to_metrics()
    flow = fed(GradientFlow(beta=0.9), data).to_metrics()
    for name, blocks in data.items():
        h = torch.cat(blocks).double().numpy()
        rate = (h > 0).mean(0)
        assert relu[f"probes/relu/{name}/active_rate"] == pytest.approx(rate.tolist())
        assert relu[f"probes/relu/{name}/dead_fraction"] == pytest.approx(np.mean(rate == 0))
        mean_abs = np.abs(h).mean(0)
        dormant = np.mean(mean_abs / mean_abs.mean() <= 0.025)
        assert relu[f"probes/relu/{name}/dormant_fraction"] == pytest.approx(dormant)
        assert relu[f"probes/relu/{name}/zero_fraction"] == pytest.approx(np.mean(h <= 0))
        ema = np.zeros(64)
        for block in blocks:  # Adam-style bias-corrected EMA of the per-pass RMS
            ema = 0.9 * ema + 0.1 * np.sqrt((block.double().numpy() ** 2).mean(0))
        rms = ema / (1 - 0.9 ** len(blocks))
        assert flow[f"probes/gradient_flow/{name}/rms"] == pytest.approx(rms.tolist())
        assert flow[f"probes/gradient_flow/{name}/mean"] == pytest.approx(rms.mean())


@pytest.mark.parametrize("width", [64, 5])
def test_a_window_drained_in_parts_and_resumed_mid_window_keeps_its_numbers(width) -> None:
    data = pushes(width, passes=6)
    first = {name: blocks[:3] for name, blocks in data.items()}
    second = {name: blocks[3:] for name, blocks in data.items()}
    whole = fed(ReLUActivation(), data).to_metrics()  # one drain
    if width == 64:  # as each stream reduced on its own, byte for byte
        assert whole == fed(ReLUActivation(), data, batch=False).to_metrics()
    parts = fed(ReLUActivation(), first)
    parts.flush()  # drained: the streams' accumulators are views of the shared ones
    saved = copy.deepcopy(parts.state_dict())
    fed(parts, second)
    parts_metrics = parts.to_metrics()
    # float32 column sums of two drains added in float64: equal to one drain's to rounding
    for key, value in parts_metrics.items():
        assert value == pytest.approx(whole[key], rel=1e-6, abs=1e-12), key
    resumed = ReLUActivation()
    for name in NAMES:
        resumed.register_component(name)
    resumed.load_state_dict(saved)  # accumulated apart: this window goes on without views
    fed(resumed, second)
    assert resumed.to_metrics() == parts_metrics


def test_a_stream_changed_in_place_loses_its_own_window_only() -> None:
    data = pushes(64, passes=1)
    tracker = fed(ReLUActivation(), data)
    data["b.layer_0"][0].mul_(2.0)  # after the hook read it
    metrics = tracker.to_metrics()
    assert "b.layer_0" in tracker.errors and "InPlaceModified" in tracker.errors["b.layer_0"]
    assert not any(k.startswith("probes/relu/b.layer_0/") for k in metrics)
    alone = {n: b for n, b in data.items() if n != "b.layer_0"}
    expected = fed(ReLUActivation(), alone, batch=False).to_metrics()
    assert {k: v for k, v in metrics.items() if k in expected} == expected


def test_streams_that_are_not_alike_are_reduced_apart() -> None:
    data = pushes(64, passes=2)
    data["b.layer_1"] = [rows(16, 32, 7), rows(16, 32, 8)]  # narrower
    data["b.layer_0"] = [rows(8, 64, 9), rows(16, 64, 10)]  # other pushes
    tracker = fed(ReLUActivation(), data)
    tracker.flush()
    assert [len(members) for members in tracker.alike] == [2]
    assert tracker.to_metrics() == fed(ReLUActivation(), data, batch=False).to_metrics()


def test_fisher_reduces_alike_output_gradients_as_one_and_its_layers_apart() -> None:
    grads = {c: [rows(16, 64, 10 * i + p) for p in range(3)] for i, c in enumerate("ab")}

    def fisher(batch: bool) -> FisherInformation:
        tracker = FisherInformation()
        if not batch:
            tracker.batches = lambda stream: False
        for component in grads:
            tracker.register_component(component)
        for p in range(3):
            for component, blocks in grads.items():
                tracker.update(component, blocks[p])
        return tracker

    together = fisher(True)
    together.flush()
    assert list(together.alike) == [(("a", "out"), ("b", "out"))]
    metrics = together.to_metrics()
    assert metrics == fisher(False).to_metrics()
    for component, blocks in grads.items():  # per unit: mean of (f g)^2, f = 16 rows
        g = torch.cat(blocks).double() * 16
        expected = (g**2).mean(0).tolist()
        assert metrics[f"probes/fisher/{component}/unit"] == pytest.approx(expected)
