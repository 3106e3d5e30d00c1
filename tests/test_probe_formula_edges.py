"""Edge cases of the probes' formulas that a mutated operator would get wrong (issue 26,
item 17): equality at a threshold, a stated loss scale with a summed loss, and a unit
with no finite value in the ReDo layer mean. Each value is computed independently."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyPolicy
from test_probe_fisher import check, make_batches, per_sample_loss, reference_fisher
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)


def identity_component() -> PolicyAutoBuilder:
    return PolicyAutoBuilder.wrap(nn.Sequential(nn.Identity()), {"feat": "0"})


def test_dormant_fraction_at_tau_zero_equals_dead_fraction(device: torch.device) -> None:
    """ReDo's rule is ``s <= tau``: with tau = 0 exactly the units whose |h| is always 0
    (score 0) are dormant, which are the dead units here (no negative values)."""
    model = identity_component().to(device)
    ctx = ComponentContext()
    model.attach("feat", attach_relu_activation_hooks(tau=0.0), ctx)
    model(torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 3.0, 0.0, 0.5]]).to(device))
    got = StatsReporter(ctx).collect()
    assert got["probes/relu/feat/dead_fraction"] == pytest.approx(0.5)  # units 0 and 2
    assert got["probes/relu/feat/dormant_fraction"] == got["probes/relu/feat/dead_fraction"]


def test_saturated_units_fraction_counts_a_rate_equal_to_the_unit_threshold(
    device: torch.device,
) -> None:
    """A unit saturated in exactly ``unit_threshold`` of its rows counts (``>=``)."""
    model = identity_component().to(device)
    ctx = ComponentContext()
    builder = attach_saturated_activation_hooks("tanh", threshold=0.9, unit_threshold=0.5)
    model.attach("feat", builder, ctx)
    h = torch.tensor([[0.99, 0.99, 0.1], [0.1, 0.99, 0.1], [-0.99, 0.1, 0.1], [0.2, 0.2, 0.1]])
    h = h.to(device)
    model(h)
    got = StatsReporter(ctx).collect()
    rate = (h.abs() > 0.9).double().mean(0)  # 0.5, 0.5, 0.0
    assert got["probes/saturation_tanh/feat/saturation_rate"] == pytest.approx(rate.cpu().tolist())
    assert got["probes/saturation_tanh/feat/saturated_units_fraction"] == pytest.approx(2 / 3)


def test_redo_layer_mean_leaves_out_units_without_a_finite_value(device: torch.device) -> None:
    """Unit 0 is NaN in every row: it has no score and is not in the layer mean. Mean
    |h| of units 1-3 is 1, 1, 0.08; layer mean 2.08/3, so unit 3 scores 0.1154 (dormant at
    tau = 0.13); counting unit 0 as 0 in the mean would give 0.1538 (not dormant)."""
    model = identity_component().to(device)
    ctx = ComponentContext()
    model.attach("feat", attach_relu_activation_hooks(tau=0.13), ctx)
    nan = float("nan")
    h = torch.tensor([[nan, 1.0, 0.5, 0.08], [nan, 1.0, 1.5, 0.08]]).to(device)
    model(h)
    got = StatsReporter(ctx).collect()
    mean_abs = h[:, 1:].abs().mean(0).double()
    score = mean_abs / mean_abs.mean()
    assert score[2].item() == pytest.approx(0.08 / (2.08 / 3))
    assert got["probes/relu/feat/dormant_fraction"] == pytest.approx(1 / 3)
    scores = ctx.model_metrics["relu"].scores["feat"]  # the probe's scores, on the host
    assert torch.isnan(scores[0])
    torch.testing.assert_close(scores[1:].double().cpu(), score.cpu(), rtol=1e-6, atol=0.0)


def test_fisher_with_sum_reduction_divides_by_the_stated_loss_scale(device: torch.device) -> None:
    """``L = c * sum_i l_i`` with c = 0.25 (context.loss_scale): the per-sample gradient
    is g_i / c, so the Fisher is that of the unscaled per-sample losses."""
    torch.manual_seed(4)
    policy = TinyPolicy(activation="relu").to(device)
    ctx = ComponentContext()
    policy.attach(
        "actor_mlp", attach_fisher_information_hooks(loss_reduction="sum"), ctx, backward=True
    )
    # drawn on the CPU (the same numbers on every device), then moved
    batches = [(x.to(device), a.to(device)) for x, a in make_batches((10, 6))]
    ctx.loss_scale = 0.25
    for x, a in batches:
        (per_sample_loss(policy(x), a).sum() * ctx.loss_scale).backward()
    fisher = ctx.model_metrics["fisher"].param_fisher("actor_mlp")
    got = StatsReporter(ctx).collect()
    ref, ref_unit = reference_fisher(policy, batches)  # on the model's device
    # compared on the host, where param_fisher gives the probe's Fisher
    check(got, fisher, {k: v.cpu() for k, v in ref.items()}, ref_unit.cpu())
