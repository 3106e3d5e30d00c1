"""Gradient-flow and ReLU gradient-flow probes against autograd.grad on the same passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeError,
    StatsReporter,
    attach_gradient_flow_hooks,
    attach_relu_gradient_flow_hooks,
)

REL = 1e-5


def batches(
    sizes: tuple[int, ...], seed: int = 3, device: torch.device = torch.device("cpu")
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Drawn on the CPU (the same numbers on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    drawn = [
        (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes
    ]
    return [(x.to(device), a.to(device)) for x, a in drawn]


def loss_fn(logits: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, a)


def test_gradient_flow_is_bias_corrected_ema_of_per_pass_rms(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    ctx = ComponentContext()
    beta = 0.8
    tiny_policy.attach("actor_mlp", attach_gradient_flow_hooks(beta=beta), ctx, backward=True)
    data = batches((10, 4, 13, 7), device=device)
    for x, a in data:
        loss_fn(tiny_policy(x), a).backward()
    got = StatsReporter(ctx).collect()
    tiny_policy.remove_hooks()
    # reference: the gradient of the same loss w.r.t. the component output, pass by pass
    ema = torch.zeros(6, dtype=torch.float64, device=device)
    for x, a in data:
        h = tiny_policy.actor_mlp(x).detach().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_fn(tiny_policy.actor_head(h), a), h)
        rms = g.double().pow(2).mean(0).sqrt()
        ema = beta * ema + (1 - beta) * rms
    rms_ref = ema / (1 - beta ** len(data))
    prefix = "probes/gradient_flow/actor_mlp/"
    assert got[prefix + "rms"] == pytest.approx(rms_ref.cpu().tolist(), rel=REL)
    assert got[prefix + "mean"] == pytest.approx(rms_ref.mean().item(), rel=REL)
    assert got[prefix + "min"] == pytest.approx(rms_ref.min().item(), rel=REL)
    assert got[prefix + "blocked_fraction"] == pytest.approx(
        (rms_ref < 1e-8).double().mean().item()
    )
    assert got[prefix + "passes"] == 4


def test_gradient_flow_reports_blocked_units(device: torch.device) -> None:
    torch.manual_seed(1)
    policy = TinyPolicy().to(device)
    with torch.no_grad():  # the head ignores output unit 2: it receives no gradient
        policy.actor_head.weight[:, 2] = 0.0
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_gradient_flow_hooks(), ctx, backward=True)
    x, a = batches((16,), device=device)[0]
    loss_fn(policy(x), a).backward()
    got = StatsReporter(ctx).collect()
    assert got["probes/gradient_flow/actor_mlp/rms"][2] == 0.0
    assert got["probes/gradient_flow/actor_mlp/blocked_fraction"] == pytest.approx(1 / 6)


def test_relu_gradient_flow_matches_gradient_at_relu_inputs(device: torch.device) -> None:
    torch.manual_seed(2)
    policy = TinyPolicy().to(device)
    with torch.no_grad():
        policy.actor_mlp.layer_0.linear.bias[1] = -100.0  # never active: blocks its gradient
    ctx = ComponentContext()
    probe_builder = attach_relu_gradient_flow_hooks()
    policy.attach("actor_mlp", probe_builder, ctx, backward=True, per_layer=False)  # per ReLU
    data = batches((9, 14), device=device)
    for x, a in data:
        loss_fn(policy(x), a).backward()
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    # reference: autograd gradient w.r.t. each ReLU's input (the Linear output)
    passed = {
        "layer_0.act": torch.zeros(7, device=device),
        "layer_1.act": torch.zeros(6, device=device),
    }
    n = 0
    for x, a in data:
        z0 = policy.actor_mlp.layer_0.linear(x)
        h0 = torch.relu(z0)
        z1 = policy.actor_mlp.layer_1.linear(h0)
        out = policy.actor_head(torch.relu(z1))
        g0, g1 = torch.autograd.grad(loss_fn(out, a), (z0, z1))
        passed["layer_0.act"] += (g0 != 0).double().sum(0)
        passed["layer_1.act"] += (g1 != 0).double().sum(0)
        n += x.shape[0]
    prefix = "probes/relu_gradient_flow/actor_mlp/"
    for layer, count in passed.items():
        rate = count / n
        assert got[prefix + f"{layer}.pass_rate"] == pytest.approx(rate.cpu().tolist(), rel=REL)
        assert got[prefix + f"{layer}.blocked_fraction"] == pytest.approx(
            (rate == 0).double().mean().item()
        )
    both = torch.cat([passed["layer_0.act"], passed["layer_1.act"]]) / n
    assert got[prefix + "pass_rate"] == pytest.approx(both.cpu().tolist(), rel=REL)
    assert got[prefix + "blocked_fraction"] == pytest.approx((both == 0).double().mean().item())
    assert got[prefix + "layer_0.act.pass_rate"][1] == 0.0


def test_relu_gradient_flow_on_a_relu_component_itself(device: torch.device) -> None:
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    torch.manual_seed(0)
    model = PolicyAutoBuilder.wrap(net, {"relu": "1"}, example_inputs=(torch.zeros(1, 5),))
    model.to(device)
    ctx = ComponentContext()
    model.attach("relu", attach_relu_gradient_flow_hooks(), ctx, backward=True)
    x, a = batches((12,), device=device)[0]
    loss_fn(model(x), a).backward()
    got = StatsReporter(ctx).collect()
    model.remove_hooks()
    z = net[0](x)
    (g,) = torch.autograd.grad(loss_fn(net[2](torch.relu(z)), a), z)
    assert got["probes/relu_gradient_flow/relu/pass_rate"] == pytest.approx(
        (g != 0).double().mean(0).cpu().tolist()
    )
    assert "probes/relu_gradient_flow/relu/<self>.pass_rate" not in got


def test_relu_gradient_flow_needs_an_nn_relu() -> None:
    model = PolicyAutoBuilder.wrap(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), {"body": "0"})
    with pytest.raises(ProbeError, match="holds no nn.ReLU"):
        model.attach("body", attach_relu_gradient_flow_hooks(), ComponentContext(), backward=True)
