"""ReLU probe: the ReDo dormant fraction at several thresholds, per layer and under a
row mask, against the score written out with loops over units."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyPolicy

from policy_probes import ComponentContext, StatsReporter, attach_relu_activation_hooks


def dormant_by_loops(h: torch.Tensor, tau: float) -> float:
    """ReDo (Sokar et al., 2023): s_i = mean|h_i| / (mean_j mean|h_j| + 1e-9), dormant if
    s_i <= tau; one unit at a time (on a host copy)."""
    h = h.cpu()
    units = h.shape[1]
    means = [sum(abs(float(v)) for v in h[:, u]) / h.shape[0] for u in range(units)]
    layer = sum(means) / units
    return sum(1 for m in means if m / (layer + 1e-9) <= tau) / units


def layer_outputs(policy: TinyPolicy, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        h0 = policy.actor_mlp.layer_0(x)
        return [h0, policy.actor_mlp.layer_1(h0)]


def test_every_threshold_per_layer_and_under_a_row_mask(device: torch.device) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy(hidden=(8, 6)).to(device)
    with torch.no_grad():  # units of every kind: dead, tiny, ordinary
        policy.actor_mlp.layer_0.linear.bias[:3] = torch.tensor([-50.0, -2.0, -1.0]).to(device)
        policy.actor_mlp.layer_1.linear.weight[0] *= 0.01
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    xs = [torch.randn(12, 5).to(device), torch.randn(7, 5).to(device)]
    masks = [torch.tensor([1.0, 0.0] * 6).to(device), torch.ones(7).to(device)]
    for x, m in zip(xs, masks, strict=True):
        ctx.row_mask = m
        policy(x)
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    kept = torch.cat([x[m.bool()] for x, m in zip(xs, masks, strict=True)])
    h0, h1 = layer_outputs(policy, kept)
    for name, h in (("actor_mlp.layer_0", h0), ("actor_mlp.layer_1", h1), ("actor_mlp", h1)):
        for tau, key in ((0.0, "0"), (0.025, "0.025"), (0.1, "0.1")):
            want = dormant_by_loops(h.double(), tau)
            assert got[f"probes/relu/{name}/dormant_fraction_tau_{key}"] == pytest.approx(want)
        # today's key is unchanged: the fraction at tau
        assert got[f"probes/relu/{name}/dormant_fraction"] == pytest.approx(
            dormant_by_loops(h.double(), 0.025)
        )
    # the three thresholds tell the layers apart (not all equal)
    assert got["probes/relu/actor_mlp.layer_0/dormant_fraction_tau_0"] > 0
    assert (
        got["probes/relu/actor_mlp.layer_0/dormant_fraction_tau_0.1"]
        >= got["probes/relu/actor_mlp.layer_0/dormant_fraction_tau_0"]
    )


def test_custom_thresholds_and_bad_ones(device: torch.device) -> None:
    torch.manual_seed(3)  # scores at least 0.1 from the threshold 0.5 (checked below)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_relu_activation_hooks(taus=(0.5,)), ctx, per_layer=False)
    x = torch.randn(9, 5).to(device)
    policy(x)
    got = StatsReporter(ctx).collect()
    h = layer_outputs(policy, x)[1]
    means = h.double().abs().mean(0)
    scores = means / (means.mean() + 1e-9)
    # no unit near the threshold: float32 rounding cannot move one across it
    assert float((scores - 0.5).abs().min()) > 0.1
    assert 0 < dormant_by_loops(h.double(), 0.5) < 1
    assert got["probes/relu/actor_mlp/dormant_fraction_tau_0.5"] == pytest.approx(
        dormant_by_loops(h.double(), 0.5)
    )
    assert "probes/relu/actor_mlp/dormant_fraction_tau_0.1" not in got
    with pytest.raises(ValueError, match="taus"):
        attach_relu_activation_hooks(taus=(-1.0,))
