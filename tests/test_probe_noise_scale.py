"""Gradient noise scale of the Fisher probe against per-sample gradients from
torch.func (vmap of grad), per parameter, for the component, and under a row mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy
from torch.func import functional_call, grad, vmap

from policy_probes import ComponentContext, StatsReporter, attach_fisher_information_hooks


def per_sample_grads(policy: TinyPolicy, x: torch.Tensor, a: torch.Tensor) -> dict:
    mlp = policy.actor_mlp
    params = {k: v.detach() for k, v in mlp.named_parameters()}

    def loss_one(p: dict, xi: torch.Tensor, ai: torch.Tensor) -> torch.Tensor:
        logits = policy.actor_head(functional_call(mlp, p, (xi[None],)))
        return F.cross_entropy(logits, ai[None])

    return {
        k: g.detach().double()
        for k, g in vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, a).items()
    }


def b_simple(grads: list[torch.Tensor]) -> tuple[float, float, float]:
    """(|G|², tr Σ, B_simple) from per-sample gradients (N, ...) written out: the
    unbiased two-batch-size estimates with batch sizes 1 and N."""
    n = grads[0].shape[0]
    s = sum(float(g.reshape(n, -1).square().sum()) for g in grads) / n
    gbar = sum(float(g.mean(0).square().sum()) for g in grads)
    g2 = (n * gbar - s) / (n - 1)
    var = n * (s - gbar) / (n - 1)
    return g2, var, var / g2


@pytest.mark.parametrize("masked", [False, True])
def test_noise_scale_matches_per_sample_gradients(masked: bool, device: torch.device) -> None:
    torch.manual_seed(3)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_fisher_information_hooks(), ctx, backward=True)
    gen = torch.Generator().manual_seed(5)
    data = [  # drawn on the CPU (the same numbers on every device), then moved
        (
            torch.randn(n, 5, generator=gen).to(device),
            torch.randint(0, 3, (n,), generator=gen).to(device),
        )
        for n in (10, 6)
    ]
    masks = [
        torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]).to(device),
        torch.ones(6).to(device),
    ]
    for (x, a), m in zip(data, masks, strict=True):
        if masked:
            ctx.row_mask = m
            losses = F.cross_entropy(policy(x), a, reduction="none")
            ((losses * m).sum() / m.sum()).backward()
        else:
            F.cross_entropy(policy(x), a).backward()
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    keep = [m.bool() if masked else torch.ones_like(m, dtype=torch.bool) for m in masks]
    grads: dict[str, list[torch.Tensor]] = {}
    for (x, a), k in zip(data, keep, strict=True):
        for name, g in per_sample_grads(policy, x[k], a[k]).items():
            grads.setdefault(name, []).append(g)
    stacked = {name: torch.cat(gs) for name, gs in grads.items()}
    prefix = "probes/fisher/actor_mlp/"
    for name, g in stacked.items():
        g2, var, b = b_simple([g])
        assert got[f"{prefix}{name}.grad_sq_norm"] == pytest.approx(g2, rel=1e-5, abs=1e-12)
        assert got[f"{prefix}{name}.grad_var_trace"] == pytest.approx(var, rel=1e-5)
        if g2 > 0:
            assert got[f"{prefix}{name}.grad_noise_scale"] == pytest.approx(b, rel=1e-4)
    g2, var, b = b_simple(list(stacked.values()))
    assert got[prefix + "grad_sq_norm"] == pytest.approx(g2, rel=1e-5)
    assert got[prefix + "grad_var_trace"] == pytest.approx(var, rel=1e-5)
    assert got[prefix + "grad_noise_scale"] == pytest.approx(b, rel=1e-4)
    assert got[prefix + "grad_noise_scale"] > 0
