"""The trackers' allocation-free float reductions (in-place, no bool tensors) equal the
boolean definitions they replace, with NaN/inf/zero entries, half precision, flushes of
different sizes and oversized pushes (which must not be modified in place)."""

from __future__ import annotations

import pytest
import torch
from conftest import saturation_reference

from policy_probes.probes import (
    FisherInformation,
    GradientFlow,
    ReLUActivation,
    ReLUGradientFlow,
    attach_saturated_activation_hooks,
)

torch.set_num_threads(1)


def messy(
    rows: int,
    cols: int,
    seed: int,
    dtype=torch.float32,
    device: torch.device = torch.device("cpu"),
) -> torch.Tensor:
    """Drawn and edited on the CPU (the same numbers on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x[x.abs() < 0.3] = 0.0
    x[0, 0], x[1, 1], x[2, 0], x[3, 2] = float("nan"), float("inf"), float("-inf"), 0.97
    return x.to(dtype).to(device)


def flushed(tracker, push) -> dict[str, torch.Tensor]:
    tracker.register_component("c")
    push(tracker)
    tracker.flush()
    return tracker.state["c"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_counts(dtype, device: torch.device):
    x = messy(40, 5, 0, dtype, device)
    st = flushed(ReLUActivation(), lambda t: (t.update("c", x[:25]), t.update("c", x[25:])))
    h = x.double()
    finite = torch.isfinite(h)
    clean = torch.where(finite, h, 0.0)
    assert st["count"].cpu().tolist() == finite.sum(0).cpu().tolist()
    assert st["active"].cpu().tolist() == (clean > 0).sum(0).cpu().tolist()
    assert st["nonfinite"].cpu().tolist() == (~finite).sum(0).cpu().tolist()
    assert int(st["nonfinite"].sum()) == 3
    torch.testing.assert_close(st["abs_sum"], clean.abs().sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
def test_saturation_counts(activation, device: torch.device):
    x = messy(30, 4, 1, device=device)
    if activation == "sigmoid":
        x = torch.where(torch.isfinite(x), torch.sigmoid(3 * x), x)
        x[4, 1], x[5, 3] = 0.02, 0.99
    else:
        x = torch.where(torch.isfinite(x), torch.tanh(2 * x), x)
    st = flushed(attach_saturated_activation_hooks(activation), lambda t: t.update("c", x))
    h = x.double()
    finite = torch.isfinite(h)
    clean = torch.where(finite, h, 0.0)
    sat, deriv = saturation_reference(clean, activation, 0.95)
    assert st["count"].cpu().tolist() == finite.sum(0).cpu().tolist()
    assert st["saturated"].cpu().tolist() == (sat & finite).sum(0).cpu().tolist()
    assert st["nonfinite"].item() == 3
    expected = torch.where(finite, deriv, 0.0).sum()
    assert st["derivative_sum"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_fisher_rows_with_nonfinite_entries_are_dropped(device: torch.device):
    x, g = messy(24, 3, 2, device=device), messy(24, 5, 3, device=device)
    x[7, 2] = float("nan")  # a bad input drops sample 7 as well
    st = flushed(
        FisherInformation(),
        lambda t: (
            t.update_layer("c", "linear", ("w", "b"), x, g),
            t.update("c", g),
        ),
    )
    ok = torch.isfinite(g).all(1) & torch.isfinite(x).all(1)
    f = 24.0  # per-sample factor of a mean loss over 24 rows
    gd, xd = (g.double() * f)[ok], x.double()[ok]
    torch.testing.assert_close(st["param:w"], (gd**2).T @ (xd**2), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(st["param:b"], (gd**2).sum(0), rtol=1e-5, atol=1e-9)
    assert st["param_samples:w"].item() == int(ok.sum())
    finite = torch.isfinite(g)
    gc = torch.where(finite, g.double() * f, 0.0)
    torch.testing.assert_close(st["unit_sq"], (gc**2).sum(0), rtol=1e-5, atol=1e-9)
    assert st["unit_count"].cpu().tolist() == finite.sum(0).cpu().tolist()


def test_gradient_flow_passes_and_counts(device: torch.device):
    g = messy(36, 4, 4, device=device)
    st = flushed(GradientFlow(), lambda t: [t.update("c", part) for part in g.split([12, 12, 12])])
    beta, ema = 0.95, torch.zeros(4, dtype=torch.float64, device=device)
    for part in g.double().split([12, 12, 12]):
        finite = torch.isfinite(part)
        clean = torch.where(finite, part, 0.0)
        rms = ((clean**2).sum(0) / finite.sum(0).clamp(min=1)).sqrt()
        ema = beta * ema + (1 - beta) * rms
    torch.testing.assert_close(st["ema"], ema, rtol=1e-6, atol=1e-12)
    assert st["count"].cpu().tolist() == torch.isfinite(g).sum(0).cpu().tolist()
    assert st["nonfinite"].cpu().tolist() == (~torch.isfinite(g)).sum(0).cpu().tolist()
    assert st["passes"].cpu().tolist() == [3.0] * 4  # per unit


def test_relu_gradient_flow_passed(device: torch.device):
    g, out = messy(20, 6, 5, device=device), messy(20, 6, 6, device=device).clamp(min=0)
    out[9, 4] = float("nan")
    out[3, 2] = float("inf")  # g[3, 2] is finite: a non-finite output does not pass
    st = flushed(ReLUGradientFlow(), lambda t: t.update("c", "l", g, out))
    finite = torch.isfinite(g)
    passed = (g != 0) & (torch.where(torch.isfinite(out), out, 0.0) > 0) & finite
    assert st["count:l"].cpu().tolist() == finite.sum(0).cpu().tolist()
    assert st["passed:l"].cpu().tolist() == passed.sum(0).cpu().tolist()


def test_oversized_push_is_reduced_without_touching_the_input(device: torch.device):
    tracker = ReLUActivation()
    tracker.buffer_rows = 8
    x = messy(30, 3, 7, device=device)
    before = x.clone()
    st = flushed(tracker, lambda t: t.update("c", x))
    assert torch.equal(x.nan_to_num(9.0, 9.0, 9.0), before.nan_to_num(9.0, 9.0, 9.0))
    assert st["count"].sum().item() == 87
    # the buffer grew to hold the push (it drains with the other probes' rows)
    assert tracker.buffers[("c", "h")].capacity == 30
