"""Pre-activation probe: per-layer mean/std, drift from the first reports and the feature
norm, against the pre-activations recomputed by hand (loops over units), under a row mask."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyPolicy

from policy_probes import ComponentContext, StatsReporter
from policy_probes.probes.preactivation import attach_preactivation_hooks


def pre_activations(policy: TinyPolicy, x: torch.Tensor) -> dict[str, torch.Tensor]:
    mlp = policy.actor_mlp
    with torch.no_grad():
        z0 = mlp.layer_0.linear(x)
        z1 = mlp.layer_1.linear(torch.relu(z0))
    return {"actor_mlp.layer_0.linear": z0.double(), "actor_mlp.layer_1.linear": z1.double()}


def unit_moments(z: torch.Tensor) -> list[tuple[float, float]]:
    z = z.cpu()  # element by element on a host copy
    out = []
    for u in range(z.shape[1]):
        col = [float(v) for v in z[:, u]]
        mu = sum(col) / len(col)
        out.append((mu, math.sqrt(max(sum(c * c for c in col) / len(col) - mu * mu, 0.0))))
    return out


def test_layer_moments_drift_and_feature_norm_over_four_reports_with_a_mask(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_preactivation_hooks(reference_epochs=2), ctx)
    gen = torch.Generator().manual_seed(1)
    kept_by_epoch = []
    got_by_epoch = []
    for epoch in range(4):
        shift = 0.0 if epoch < 2 else 1.5 * epoch  # the input distribution moves later
        kept = []
        for n in (9, 6):
            x = (torch.randn(n, 5, generator=gen) + shift).to(device)
            mask = (torch.arange(n) % 3 != 0).double().to(device)  # every third row left out
            ctx.row_mask = mask
            policy(x)
            kept.append(x[mask.bool()])
        ctx.row_mask = None
        kept_by_epoch.append(torch.cat(kept))
        got_by_epoch.append(StatsReporter(ctx).collect())
    policy.remove_hooks()
    reference = torch.cat(kept_by_epoch[:2])
    for epoch, (x, got) in enumerate(zip(kept_by_epoch, got_by_epoch, strict=True)):
        now = pre_activations(policy, x)
        ref = pre_activations(policy, reference)
        for layer, z in now.items():
            m = unit_moments(z)
            # the reference after this report: the first two reports' rows
            r = unit_moments(ref[layer] if epoch >= 1 else z)
            key = f"probes/preactivation/{layer}/"
            assert got[key + "mean"] == pytest.approx(sum(a for a, _ in m) / len(m), abs=1e-6)
            assert got[key + "std"] == pytest.approx(sum(b for _, b in m) / len(m), rel=1e-5)
            drift = sum(
                abs(a - a0) / (b0 + 1e-8) for (a, _), (a0, b0) in zip(m, r, strict=True)
            ) / len(m)
            ratio = sum(b / (b0 + 1e-8) for (_, b), (_, b0) in zip(m, r, strict=True)) / len(m)
            assert got[key + "mean_drift"] == pytest.approx(drift, rel=1e-5, abs=1e-6)
            assert got[key + "std_ratio"] == pytest.approx(ratio, rel=1e-5)
        with torch.no_grad():
            y = policy.actor_mlp(x).double()
        norms = [math.sqrt(sum(float(v) ** 2 for v in row)) for row in y.cpu()]
        assert got["probes/preactivation/actor_mlp/feature_norm"] == pytest.approx(
            sum(norms) / len(norms), rel=1e-6
        )
    # the inputs moved: the last report's first layer has drifted by more than its spread
    assert got_by_epoch[-1]["probes/preactivation/actor_mlp.layer_0.linear/mean_drift"] > 1.0
    assert got_by_epoch[0]["probes/preactivation/actor_mlp.layer_0.linear/mean_drift"] == 0.0


def test_reference_survives_a_checkpoint(device: torch.device) -> None:
    torch.manual_seed(2)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_preactivation_hooks(reference_epochs=1), ctx)
    x0 = torch.randn(8, 5).to(device)
    policy(x0)
    StatsReporter(ctx).collect()
    saved = ctx.model_metrics["preactivation"].state_dict()
    policy.remove_hooks()
    ctx2 = ComponentContext()
    policy.attach("actor_mlp", attach_preactivation_hooks(reference_epochs=1), ctx2)
    ctx2.model_metrics["preactivation"].load_state_dict(saved)
    x1 = (torch.randn(8, 5) + 2.0).to(device)
    policy(x1)
    got = StatsReporter(ctx2).collect()
    m = unit_moments(pre_activations(policy, x1)["actor_mlp.layer_0.linear"])
    r = unit_moments(pre_activations(policy, x0)["actor_mlp.layer_0.linear"])
    drift = sum(abs(a - a0) / (b0 + 1e-8) for (a, _), (a0, b0) in zip(m, r, strict=True)) / len(m)
    assert got["probes/preactivation/actor_mlp.layer_0.linear/mean_drift"] == pytest.approx(
        drift, rel=1e-6
    )
    with pytest.raises(ValueError, match="reference_epochs"):
        attach_preactivation_hooks(reference_epochs=0)
