"""Fisher probe against per-sample gradients from torch.func.vmap(torch.func.grad(...))."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy
from torch import nn
from torch.func import functional_call, grad, vmap

from policy_probes import (
    ComponentContext,
    FisherInformation,
    PolicyAutoBuilder,
    StatsReporter,
    attach_fisher_information_hooks,
)

REL = 1e-5


def per_sample_loss(logits: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, action, reduction="none")


def reference_fisher(
    policy: TinyPolicy, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict, torch.Tensor]:
    """Mean over all samples of squared per-sample gradients of l_i, for every parameter
    of actor_mlp and for the actor_mlp output units."""
    if isinstance(policy, PolicyAutoBuilder):
        policy.remove_hooks()
    mlp = policy.actor_mlp
    params = {k: v.detach() for k, v in mlp.named_parameters()}

    def loss_one(p: dict, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = functional_call(mlp, p, (x[None],))
        return per_sample_loss(policy.actor_head(h), a[None])[0]

    sq = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    unit_sq, n = None, 0
    for x, a in batches:
        grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, a)
        for k, g in grads.items():
            sq[k] += (g.double() ** 2).sum(0)
        h = mlp(x).detach().requires_grad_(True)
        (gh,) = torch.autograd.grad(per_sample_loss(policy.actor_head(h), a).sum(), h)
        unit_sq = (
            (gh.double() ** 2).sum(0) if unit_sq is None else unit_sq + (gh.double() ** 2).sum(0)
        )
        n += x.shape[0]
    return {k: v / n for k, v in sq.items()}, unit_sq / n


def body_squared_gradients(
    body: nn.Module, head: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Sum over all samples of the squared per-sample gradient of every parameter of
    ``body`` (``vmap`` of ``grad``), for the loss of ``head(body(x))``."""
    params = {k: v.detach() for k, v in body.named_parameters()}

    def loss_one(p: dict, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(head(functional_call(body, p, (x[None],))), a[None])[0]

    sq = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    # cuDNN's recurrent kernels take no vmap (their flat weights need storage)
    with torch.backends.cudnn.flags(enabled=False):
        for x, a in batches:
            for k, g in vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, a).items():
                sq[k] += (g.double() ** 2).sum(0)
    return sq


def make_batches(
    sizes: tuple[int, ...], device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded minibatches (x, action), drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(7)
    drawn = [
        (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes
    ]
    return [(x.to(device), a.to(device)) for x, a in drawn]


def check(got: dict, tracker_fisher: dict, ref: dict, ref_unit: torch.Tensor) -> None:
    """The probe's metrics and per-entry Fisher against the reference (compared on the
    host: the reference lies on the model's device)."""
    prefix = "probes/fisher/actor_mlp/"
    assert got[prefix + "unit"] == pytest.approx(ref_unit.cpu().tolist(), rel=REL)
    assert set(tracker_fisher) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(tracker_fisher[name].cpu(), value.cpu(), rtol=REL, atol=1e-12)
        assert got[prefix + f"{name}.trace"] == pytest.approx(value.sum().item(), rel=REL)
    allf = torch.cat([v.reshape(-1) for v in ref.values()])
    assert got[prefix + "trace"] == pytest.approx(allf.sum().item(), rel=REL)
    assert got[prefix + "mean"] == pytest.approx(allf.mean().item(), rel=REL)
    assert got[prefix + "max"] == pytest.approx(allf.max().item(), rel=REL)
    assert got[prefix + "dead_param_fraction"] == pytest.approx(
        (allf < 1e-8).double().mean().item()
    )


def run_and_collect(
    policy: TinyPolicy, ctx: ComponentContext, batches, micro: int = 1
) -> tuple[dict, dict]:
    for x, a in batches:
        n = x.shape[0]
        for xs, as_ in zip(x.chunk(micro), a.chunk(micro), strict=True):
            ctx.loss_scale = xs.shape[0] / n
            loss = per_sample_loss(policy(xs), as_).mean() * ctx.loss_scale
            loss.backward()
    tracker = ctx.model_metrics["fisher"]
    assert isinstance(tracker, FisherInformation)
    fisher = tracker.param_fisher("actor_mlp")
    return StatsReporter(ctx).collect(), fisher


def train_body_with_fisher(
    body: nn.Module, head: nn.Module, device: torch.device | str = "cpu"
) -> tuple[PolicyAutoBuilder, ComponentContext, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``head(body(x))`` moved to ``device`` (``body`` and ``head`` in place) and wrapped
    with the Fisher probe on ``body``, trained on two minibatches with a mean loss;
    returns the model, its context and the minibatches."""
    net = nn.Sequential(body, head).to(device)
    model = PolicyAutoBuilder.wrap(
        net, {"body": "0", "head": "1"}, example_inputs=(torch.zeros(1, 5).to(device),)
    )
    ctx = ComponentContext()
    model.attach("body", attach_fisher_information_hooks(), ctx, backward=True)
    batches = make_batches((11, 7), device)
    for x, a in batches:
        per_sample_loss(model(x), a).mean().backward()
    return model, ctx, batches


def fisher_policy(
    seed: int, activation: str = "relu", device: torch.device | str = "cpu", **fisher: Any
) -> tuple[TinyPolicy, ComponentContext]:
    """A seeded TinyPolicy (built on the CPU, moved to ``device``) with the Fisher probe
    (``fisher``: its settings) on actor_mlp."""
    torch.manual_seed(seed)
    policy = TinyPolicy(activation=activation).to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_fisher_information_hooks(**fisher), ctx, backward=True)
    return policy, ctx


def check_against_vmap(policy: TinyPolicy, ctx: ComponentContext, batches, micro: int = 1) -> dict:
    """Train on ``batches`` (``micro`` micro-batches each), check every Fisher value
    against :func:`reference_fisher`; returns the collected metrics."""
    got, fisher = run_and_collect(policy, ctx, batches, micro=micro)
    ref, ref_unit = reference_fisher(policy, batches)
    check(got, fisher, ref, ref_unit)
    return got


@pytest.mark.parametrize("micro", [1, 3])
def test_fisher_matches_vmap_per_sample_gradients(micro: int, device: torch.device) -> None:
    policy, ctx = fisher_policy(0, device=device)
    with torch.no_grad():  # one dead unit in layer 1: its incoming weights get zero Fisher
        policy.actor_mlp.layer_1.linear.bias[0] = -50.0
    got = check_against_vmap(policy, ctx, make_batches((12, 9, 21), device), micro=micro)
    assert got["probes/fisher/actor_mlp/dead_param_fraction"] > 0
    assert got["probes/fisher/actor_mlp/samples"] == 42


@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "leaky_relu", "identity", "gelu", "elu"])
def test_fisher_matches_vmap_for_every_activation(activation: str, device: torch.device) -> None:
    # relu/tanh/sigmoid/leaky_relu/identity layers form the Linear's output gradient from
    # the activation's output and gradient; gelu and elu hook the Linear's output itself
    policy, ctx = fisher_policy(1, activation, device=device)
    check_against_vmap(policy, ctx, make_batches((12, 9), device))


def test_fisher_with_sum_reduction(device: torch.device) -> None:
    policy, ctx = fisher_policy(4, device=device, loss_reduction="sum")
    batches = make_batches((10, 6), device)
    for x, a in batches:
        per_sample_loss(policy(x), a).sum().backward()
    fisher = ctx.model_metrics["fisher"].param_fisher("actor_mlp")
    got = StatsReporter(ctx).collect()
    ref, ref_unit = reference_fisher(policy, batches)
    check(got, fisher, ref, ref_unit)


def test_fisher_covers_nested_parameters_and_layer_norm(device: torch.device) -> None:
    """Parameters at every depth (not only direct children), LayerNorm exactly."""
    torch.manual_seed(5)
    body = nn.Sequential(
        nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Sequential(nn.Linear(8, 6), nn.ReLU())
    )
    head = nn.Linear(6, 3)
    model, ctx, batches = train_body_with_fisher(body, head, device)
    fisher = ctx.model_metrics["fisher"].param_fisher("body")
    got = StatsReporter(ctx).collect()
    model.remove_hooks()
    sq = body_squared_gradients(body, head, batches)
    assert (
        set(fisher)
        == set(sq)
        == {"0.weight", "0.bias", "1.weight", "1.bias", "3.0.weight", "3.0.bias"}
    )
    for k in sq:
        torch.testing.assert_close(fisher[k].cpu(), sq[k].cpu() / 18, rtol=REL, atol=1e-12)
    assert got["probes/fisher/body/trace"] == pytest.approx(
        sum(v.sum().item() for v in sq.values()) / 18, rel=REL
    )
    assert got["probes/fisher/body/unsupported_params"] == 0


def test_fisher_never_reads_param_grad(device: torch.device) -> None:
    """Stale .grad values (never zeroed) must not leak into the Fisher."""
    policy, ctx = fisher_policy(6, device=device)
    for p in policy.parameters():
        p.grad = torch.full_like(p, 1e3)
    check_against_vmap(policy, ctx, make_batches((8,), device))


def test_fisher_excludes_nonfinite_samples(device: torch.device) -> None:
    policy, ctx = fisher_policy(8, device=device, loss_reduction="sum")
    x, a = make_batches((10,))[0]  # on the CPU: poisoned and indexed here, then moved
    x_bad = x.clone()
    x_bad[3, 0] = float("nan")
    # sum: sample 3 only poisons itself
    per_sample_loss(policy(x_bad.to(device)), a.to(device)).sum().backward()
    fisher = ctx.model_metrics["fisher"].param_fisher("actor_mlp")
    got = StatsReporter(ctx).collect()
    assert all(torch.isfinite(v).all() for v in fisher.values())
    assert 0 < got["probes/fisher/actor_mlp/nonfinite_fraction"] < 1
    keep = torch.tensor([i != 3 for i in range(10)])
    ref, _ = reference_fisher(policy, [(x[keep].to(device), a[keep].to(device))])
    # every layer drops the poisoned sample; the mean is over the 9 others
    for name, value in ref.items():
        torch.testing.assert_close(fisher[name].cpu(), value.cpu(), rtol=REL, atol=1e-12)


def test_param_every_uses_every_kth_pass_for_parameters_and_every_pass_for_units(
    device: torch.device,
) -> None:
    policy, ctx = fisher_policy(2, device=device, param_every=3)
    batches = make_batches((12, 9, 21, 6, 10, 8, 7), device)
    got, fisher = run_and_collect(policy, ctx, batches)
    ref_params, _ = reference_fisher(policy, batches[::3])  # passes 0, 3 and 6
    _, ref_unit = reference_fisher(policy, batches)
    assert got["probes/fisher/actor_mlp/unit"] == pytest.approx(ref_unit.cpu().tolist(), rel=REL)
    assert set(fisher) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(fisher[name].cpu(), value.cpu(), rtol=REL, atol=1e-12)
    with pytest.raises(ValueError, match="param_every must be an integer >= 1"):
        attach_fisher_information_hooks(param_every=0)


def test_fisher_reads_sequential_linear_activation_pairs_through_the_activation(
    device: torch.device,
) -> None:
    # the layout of SB3's MLP extractors: Linear, activation, Linear, activation, ...
    torch.manual_seed(6)
    body = nn.Sequential(
        nn.Linear(5, 8),
        nn.Tanh(),
        nn.Linear(8, 6),
        nn.Sigmoid(),
        nn.Linear(6, 7),
        nn.LeakyReLU(0.1),
    )
    head = nn.Linear(7, 3)
    model, ctx, batches = train_body_with_fisher(body, head, device)
    tracker = ctx.model_metrics["fisher"]
    streams = sorted(stream for _, stream in tracker.buffers)
    assert streams == [
        "linear@leaky_relu=0.1:4.weight:4.bias",
        "linear@sigmoid:2.weight:2.bias",
        "linear@tanh:0.weight:0.bias",
        "out",
    ]
    fisher = tracker.param_fisher("body")
    model.remove_hooks()
    sq = body_squared_gradients(body, head, batches)
    assert set(fisher) == set(sq)
    for k in sq:
        torch.testing.assert_close(fisher[k].cpu(), sq[k].cpu() / 18, rtol=REL, atol=1e-12)
