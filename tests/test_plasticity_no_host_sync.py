"""The plasticity probes' hooks never synchronise with the host (weights, preactivation,
utility, churn and the Fisher probe's noise-scale sums), also when their buffers drain
inside the hooks and under a row mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy
from test_no_host_sync import ForbidHostSync

from policy_probes import (
    ComponentContext,
    StatsReporter,
    attach_churn_hooks,
    attach_fisher_information_hooks,
    attach_preactivation_hooks,
    attach_utility_hooks,
    attach_weights_hooks,
)


@pytest.mark.parametrize(("buffer_rows", "masked"), [(2048, False), (20, False), (20, True)])
def test_plasticity_probes_run_without_host_sync(
    buffer_rows: int, masked: bool, device: torch.device
) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_weights_hooks(), ctx)
    policy.attach("actor_mlp", attach_preactivation_hooks(), ctx)
    policy.attach("actor_mlp", attach_utility_hooks(outgoing="actor_head"), ctx)
    policy.attach("actor_head", attach_churn_hooks(kind="categorical"), ctx)
    policy.attach("actor_mlp", attach_fisher_information_hooks(), ctx, backward=True)
    for tracker in ctx.model_metrics.values():
        tracker.buffer_rows = buffer_rows
    held_out = torch.randn(8, 5).to(device)
    ctx.model_metrics["churn"].rollout_end(held_out, policy)  # before the updates
    g = torch.Generator().manual_seed(1)
    passes = []  # drawn on the CPU, moved before the block (a copy to the device syncs)
    for _ in range(5):
        x, a = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
        mask = (torch.arange(16) % 2 == 0).float().to(device) if masked else None
        passes.append((x.to(device), a.to(device), mask))
    with ForbidHostSync(device) as probed:
        for x, a, mask in passes:
            ctx.row_mask = mask
            F.cross_entropy(policy(x), a).backward()
    ctx.row_mask = None
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()  # the transfers of the report happen here
    assert not [k for k in metrics if k.startswith("probes/errors/")]
    assert "probes/preactivation/actor_mlp.layer_0.linear/mean_drift" in metrics
    assert "probes/utility/actor_mlp.layer_1/low_utility_fraction" in metrics
    assert "probes/weights/actor_mlp/norm" in metrics
    assert "probes/churn/actor_head/policy_kl" in metrics
    assert "probes/fisher/actor_mlp/grad_noise_scale" in metrics
