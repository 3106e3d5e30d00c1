"""Contribution-utility probe (continual backprop, Dohare et al. 2024): the running score
u <- decay u + (1 - decay) mean|h_i| sum_k |w_ki| per unit of every layer, written out with
loops over units and outgoing weights, over two reports, the second under a row mask."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyPolicy

from policy_probes import ComponentContext, StatsReporter
from policy_probes.probes.utility import attach_utility_hooks


def contributions(h: torch.Tensor, w_next: torch.Tensor) -> list[float]:
    h, w_next = h.cpu(), w_next.cpu()  # element by element on host copies
    out = []
    for i in range(h.shape[1]):
        mean_abs = sum(abs(float(v)) for v in h[:, i]) / h.shape[0]
        out_sum = sum(abs(float(w_next[k, i])) for k in range(w_next.shape[0]))
        out.append(mean_abs * out_sum)
    return out


def hidden(policy: TinyPolicy, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        h0 = policy.actor_mlp.layer_0(x)
        return h0, policy.actor_mlp.layer_1(h0)


def test_running_utility_per_layer_over_two_reports_with_a_mask(device: torch.device) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy(hidden=(7, 6)).to(device)
    with torch.no_grad():  # unit 2 of layer 0 passes nothing on: no outgoing weight
        policy.actor_mlp.layer_1.linear.weight[:, 2] = 0.0
    ctx = ComponentContext()
    decay = 0.8
    policy.attach("actor_mlp", attach_utility_hooks(outgoing="actor_head", decay=decay), ctx)
    x1 = torch.randn(10, 5).to(device)
    policy(x1)
    got1 = StatsReporter(ctx).collect()
    w1 = policy.actor_mlp.layer_1.linear.weight.detach().clone()
    head1 = policy.actor_head.weight.detach().clone()
    with torch.no_grad():  # the weights change between the reports
        policy.actor_head.weight.mul_(3.0)
    x2 = torch.randn(8, 5).to(device)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]).to(device)
    ctx.row_mask = mask
    policy(x2)
    ctx.row_mask = None
    got2 = StatsReporter(ctx).collect()
    h0_1, h1_1 = hidden(policy, x1)
    h0_2, h1_2 = hidden(policy, x2[mask.bool()])
    c0_1, c1_1 = contributions(h0_1, w1), contributions(h1_1, head1)
    c0_2 = contributions(h0_2, w1)
    c1_2 = contributions(h1_2, policy.actor_head.weight.detach())
    u0 = [decay * a + (1 - decay) * b for a, b in zip(c0_1, c0_2, strict=True)]
    u1 = [decay * a + (1 - decay) * b for a, b in zip(c1_1, c1_2, strict=True)]
    for got, want0, want1 in ((got1, c0_1, c1_1), (got2, u0, u1)):
        for layer, want in (("layer_0", want0), ("layer_1", want1)):
            key = f"probes/utility/actor_mlp.{layer}/"
            assert got[key + "utility"] == pytest.approx(want, rel=1e-5, abs=1e-9)
            assert got[key + "utility_mean"] == pytest.approx(sum(want) / len(want), rel=1e-5)
            low = [u / (sum(want) / len(want) + 1e-12) <= 0.025 for u in want]
            assert got[key + "low_utility_fraction"] == pytest.approx(sum(low) / len(low))
    assert got1["probes/utility/actor_mlp.layer_0/low_utility_fraction"] >= 1 / 7


def test_without_outgoing_the_last_layer_is_not_scored_and_bad_settings_fail(
    device: torch.device,
) -> None:
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_utility_hooks(), ctx)
    policy(torch.randn(4, 5).to(device))
    got = StatsReporter(ctx).collect()
    assert "probes/utility/actor_mlp.layer_0/utility_mean" in got
    assert not any(k.startswith("probes/utility/actor_mlp.layer_1/") for k in got)
    with pytest.raises(ValueError, match="decay"):
        attach_utility_hooks(decay=1.0)


def test_an_outgoing_layer_that_does_not_fit_is_reported_not_raised(
    device: torch.device,
) -> None:
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    # critic-less TinyPolicy: actor_mlp.layer_0 feeds actor_mlp.layer_1 (fits); naming the
    # first hidden layer as the reader of the last one does not fit (7 inputs, 6 units)
    policy.attach("actor_mlp", attach_utility_hooks(outgoing="actor_mlp.layer_1"), ctx)
    policy(torch.randn(4, 5).to(device))
    got = StatsReporter(ctx).collect()
    assert "probes/utility/actor_mlp.layer_0/utility_mean" in got
    assert "probes/utility/actor_mlp.layer_1/utility_mean" not in got
    assert "utility/actor_mlp.layer_1" in ctx.probe_errors
