"""ReLU and saturation probes against plain-torch computations on the same samples."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyPolicy, saturation_reference
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    StatsReporter,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)

REL = 1e-5


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-9)


def reference_relu(h: torch.Tensor, tau: float = 0.025) -> dict:
    """Definitions of the core issue, written out directly on the stacked window."""
    h = h.double().reshape(-1, h.shape[-1])
    finite = torch.isfinite(h)
    active = torch.tensor(
        [(h[finite[:, u], u] > 0).double().mean().item() for u in range(h.shape[1])]
    )
    mean_abs = torch.tensor([h[finite[:, u], u].abs().mean().item() for u in range(h.shape[1])])
    score = mean_abs / (mean_abs.mean() + 1e-9)
    vals = h[finite]
    return {
        "active_rate": active.tolist(),
        "dead_fraction": (active == 0).double().mean().item(),
        "dormant_fraction": (score <= tau).double().mean().item(),
        "rarely_active_fraction": (active < 0.05).double().mean().item(),
        "always_active_fraction": (active > 0.95).double().mean().item(),
        "zero_fraction": (vals <= 0).double().mean().item(),
        "nonfinite_fraction": 1 - finite.double().mean().item(),
    }


def collected_outputs(model: nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    """The component output for every batch, computed without any probe."""
    with torch.no_grad():
        return torch.cat([model(b) for b in batches])


def test_relu_metrics_match_reference_over_a_window(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    ctx = ComponentContext()
    tiny_policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    # make one unit dead and one always on, so the fractions are not trivially 0
    with torch.no_grad():
        last = tiny_policy.actor_mlp.layer_1.linear
        last.bias[0] = -100.0
        last.bias[1] = 100.0
    torch.manual_seed(1)
    batches = [torch.randn(n, 5).to(device) for n in (16, 9, 33)]
    for b in batches:
        tiny_policy(b)
    got = StatsReporter(ctx).collect()
    tiny_policy.remove_hooks()
    ref = reference_relu(collected_outputs(tiny_policy.actor_mlp, batches))
    prefix = "probes/relu/actor_mlp/"
    assert got[prefix + "active_rate"] == pytest.approx(ref["active_rate"], rel=REL)
    for key in (
        "dead_fraction",
        "dormant_fraction",
        "rarely_active_fraction",
        "always_active_fraction",
        "zero_fraction",
    ):
        assert close(got[prefix + key], ref[key]), key
    assert got[prefix + "dead_fraction"] >= 1 / 6
    assert got[prefix + "always_active_fraction"] >= 1 / 6
    assert got[prefix + "samples"] == 58


def test_dormant_threshold_follows_redo_definition(device: torch.device) -> None:
    """Unit 0 is active but tiny relative to the layer mean: dormant, not dead."""
    ctx = ComponentContext()
    model = PolicyAutoBuilder.wrap(nn.Sequential(nn.Identity()), {"feat": "0"}).to(device)
    model.attach("feat", attach_relu_activation_hooks(tau=0.1), ctx)
    h = torch.tensor([[0.01, 1.0, 2.0, 0.0], [0.02, 3.0, 0.5, 0.0]]).to(device)
    model(h)
    got = StatsReporter(ctx).collect()
    ref = reference_relu(h, tau=0.1)
    assert got["probes/relu/feat/dormant_fraction"] == pytest.approx(ref["dormant_fraction"])
    assert got["probes/relu/feat/dormant_fraction"] == pytest.approx(
        0.5
    )  # unit 0 and the dead unit 3
    assert got["probes/relu/feat/dead_fraction"] == pytest.approx(0.25)


def test_nonfinite_elements_are_left_out_and_counted(device: torch.device) -> None:
    ctx = ComponentContext()
    model = PolicyAutoBuilder.wrap(nn.Sequential(nn.Identity()), {"feat": "0"}).to(device)
    model.attach("feat", attach_relu_activation_hooks(), ctx)
    model.attach("feat", attach_saturated_activation_hooks("tanh"), ctx)
    torch.manual_seed(3)
    h = torch.randn(40, 6).tanh()
    h[0, 0] = float("nan")
    h[5, 2] = float("inf")
    h[7, 3] = -float("inf")
    h = h.to(device)
    model(h)
    got = StatsReporter(ctx).collect()
    ref = reference_relu(h)
    assert got["probes/relu/feat/nonfinite_fraction"] == pytest.approx(3 / 240)
    assert got["probes/relu/feat/active_rate"] == pytest.approx(ref["active_rate"], rel=REL)
    assert close(got["probes/relu/feat/zero_fraction"], ref["zero_fraction"])
    assert got["probes/saturation_tanh/feat/nonfinite_fraction"] == pytest.approx(3 / 240)
    for value in got.values():
        values = value if isinstance(value, list) else [value]
        assert all(math.isfinite(v) for v in values)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
def test_saturation_metrics_match_reference(activation: str, device: torch.device) -> None:
    torch.manual_seed(2)
    policy = TinyPolicy(activation=activation).to(device)
    with torch.no_grad():  # push some units into saturation
        policy.actor_mlp.layer_1.linear.weight[:2] *= 40
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_saturated_activation_hooks(activation, threshold=0.9), ctx)
    batches = [torch.randn(n, 5).to(device) for n in (20, 12)]
    for b in batches:
        policy(b)
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    h = collected_outputs(policy.actor_mlp, batches).double()
    sat, deriv = saturation_reference(h, activation, 0.9)
    rate = sat.double().mean(0)
    prefix = f"probes/saturation_{activation}/actor_mlp/"
    assert got[prefix + "saturation_rate"] == pytest.approx(rate.cpu().tolist(), rel=REL)
    assert close(got[prefix + "saturated_fraction"], sat.double().mean().item())
    assert close(got[prefix + "saturated_units_fraction"], (rate >= 0.99).double().mean().item())
    assert close(got[prefix + "mean_derivative"], deriv.mean().item())
    assert 0 < got[prefix + "saturated_fraction"] < 1


def test_unsupported_saturation_activation_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported activation 'relu'.*tanh"):
        attach_saturated_activation_hooks("relu")


def test_phase_gating_records_only_selected_phases(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    ctx = ComponentContext()
    tiny_policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)  # train only
    tiny_policy.attach(
        "actor_mlp.layer_0", attach_relu_activation_hooks(), ctx, phases=("rollout",)
    )
    train_x, rollout_x = torch.randn(10, 5).to(device), torch.randn(7, 5).to(device)
    ctx.phase = "rollout"
    tiny_policy(rollout_x)
    ctx.phase = "train"
    tiny_policy(train_x)
    got = StatsReporter(ctx).collect()
    assert got["probes/relu/actor_mlp/samples"] == 10
    assert got["probes/relu/actor_mlp.layer_0/samples"] == 7
    tiny_policy.remove_hooks()
    with torch.no_grad():
        ref = reference_relu(tiny_policy.actor_mlp(train_x))
    assert got["probes/relu/actor_mlp/active_rate"] == pytest.approx(ref["active_rate"], rel=REL)


def test_window_resets_after_collect(tiny_policy: TinyPolicy, device: torch.device) -> None:
    tiny_policy.to(device)
    ctx = ComponentContext()
    tiny_policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    tiny_policy(torch.randn(10, 5).to(device))
    first = StatsReporter(ctx).collect()
    assert first["probes/relu/actor_mlp/samples"] == 10
    assert StatsReporter(ctx).collect() == {}  # nothing recorded since the reset
    x = torch.randn(4, 5).to(device)
    tiny_policy(x)
    second = StatsReporter(ctx).collect()
    assert second["probes/relu/actor_mlp/samples"] == 4
    tiny_policy.remove_hooks()
    with torch.no_grad():
        ref = reference_relu(tiny_policy.actor_mlp(x))
    assert second["probes/relu/actor_mlp/active_rate"] == pytest.approx(ref["active_rate"], rel=REL)
