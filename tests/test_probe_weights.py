"""Weights probe: norms, distance from initialisation and update ratios, per layer,
against the parameters copied by hand before and after optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyPolicy

from policy_probes import ComponentContext, StatsReporter
from policy_probes.probes.weights import attach_weights_hooks


def norm(ts: list[torch.Tensor]) -> float:
    """Element by element on host copies."""
    return math.sqrt(sum(float(v) ** 2 for t in ts for v in t.cpu().reshape(-1)))


def snapshot(module: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    return {
        name: [p.detach().clone() for p in sub.parameters(recurse=False)]
        for name, sub in module.named_modules()
        if list(sub.parameters(recurse=False))
    }


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x - y for x, y in zip(a, b, strict=True)]


def train_steps(
    policy: TinyPolicy,
    opt: torch.optim.Optimizer,
    n: int,
    device: torch.device = torch.device("cpu"),
) -> None:
    """``n`` SGD steps on inputs drawn on the CPU (the same on every device), then moved."""
    for _ in range(n):
        opt.zero_grad()
        policy(torch.randn(8, 5).to(device)).square().mean().backward()
        opt.step()


def test_per_layer_norms_distances_and_update_ratios_over_two_epochs(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_weights_hooks(), ctx)
    mlp = policy.actor_mlp
    init = snapshot(mlp)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    prev = init
    for _ in range(2):
        train_steps(policy, opt, 3, device)
        got = StatsReporter(ctx).collect()
        now = snapshot(mlp)
        for layer in ("layer_0.linear", "layer_1.linear"):
            k = f"probes/weights/actor_mlp.{layer}/"
            assert got[k + "norm"] == pytest.approx(norm(now[layer]))
            assert got[k + "init_distance"] == pytest.approx(
                norm(diff(now[layer], init[layer])) / norm(init[layer])
            )
            assert got[k + "update_ratio"] == pytest.approx(
                norm(diff(now[layer], prev[layer])) / norm(prev[layer])
            )
            flat = torch.cat([p.reshape(-1) for p in now[layer]])
            assert got[k + "magnitude"] == pytest.approx(float(flat.abs().mean()))
        every = [p for ps in now.values() for p in ps]
        every0 = [p for ps in init.values() for p in ps]
        assert got["probes/weights/actor_mlp/norm"] == pytest.approx(norm(every))
        assert got["probes/weights/actor_mlp/init_distance"] == pytest.approx(
            norm(diff(every, every0)) / norm(every0)
        )
        assert got["probes/weights/actor_mlp/update_ratio"] > 0
        prev = now
    # no training since the last report: no update
    got = StatsReporter(ctx).collect()
    assert got["probes/weights/actor_mlp/update_ratio"] == 0.0


def test_references_survive_a_checkpoint(device: torch.device) -> None:
    torch.manual_seed(1)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_weights_hooks(), ctx)
    init = snapshot(policy.actor_mlp)["layer_0.linear"]
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    train_steps(policy, opt, 2, device)
    StatsReporter(ctx).collect()
    saved = ctx.model_metrics["weights"].state_dict()
    # a fresh run attached to the trained policy: without the state θ₀ would be now
    ctx2 = ComponentContext()
    policy.attach("actor_mlp", attach_weights_hooks(), ctx2)
    ctx2.model_metrics["weights"].load_state_dict(saved)
    got = StatsReporter(ctx2).collect()
    now = snapshot(policy.actor_mlp)["layer_0.linear"]
    assert got["probes/weights/actor_mlp.layer_0.linear/init_distance"] == pytest.approx(
        norm(diff(now, init)) / norm(init)
    )
    assert got["probes/weights/actor_mlp.layer_0.linear/init_distance"] > 0
