"""LoopModelDataContext: checkpoints, gradients, replayed update epochs, perturbations."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from policy_probes.lifecycle import LoopModelDataContext


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).square().mean()


def setup(
    max_grad_norm: float | None = 0.5, device: torch.device | str = "cpu"
) -> tuple[LoopModelDataContext, nn.Module, dict[str, torch.Tensor]]:
    """Model and data built on the CPU from seed 0, then moved to ``device``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
    data = {"x": torch.randn(10, 3).to(device), "y": torch.randn(10, 2).to(device)}
    ctx = LoopModelDataContext(
        model,
        opt,
        mse,
        data=data,
        minibatch_size=4,
        scheduler=sched,
        max_grad_norm=max_grad_norm,
        obs_key="x",
    )
    return ctx, model, data


def state_of(ctx: LoopModelDataContext) -> dict:
    model = ctx.model
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "opt": {
            i: {k: v.clone() for k, v in s.items()}
            for i, s in enumerate(ctx.optimizer.state.values())
        },
        "lr": ctx.optimizer.param_groups[0]["lr"],
        "sched": ctx.scheduler.last_epoch,
        "rng": (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()),
        # the CUDA generators too, once CUDA is in use (checkpoints restore them)
        "cuda_rng": tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else (),
    }


def assert_state_equal(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert all(
        (x is None and y is None) or torch.equal(x, y)
        for x, y in zip(a["grads"], b["grads"], strict=True)
    )
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        assert all(torch.equal(a["opt"][i][k], b["opt"][i][k]) for k in a["opt"][i])
    assert (a["lr"], a["sched"]) == (b["lr"], b["sched"])
    assert torch.equal(a["rng"][0], b["rng"][0]) and np.array_equal(a["rng"][1], b["rng"][1])
    assert a["rng"][2] == b["rng"][2]
    assert len(a["cuda_rng"]) == len(b["cuda_rng"])
    assert all(torch.equal(x, y) for x, y in zip(a["cuda_rng"], b["cuda_rng"], strict=True))


def test_checkpoint_restores_everything_bit_exactly_and_can_be_restored_twice(
    device: torch.device,
) -> None:
    ctx, model, _ = setup(device=device)
    ctx.run_training_epoch()
    ctx.scheduler.step()
    ctx.compute_loss().backward()
    saved = state_of(ctx)
    group = ctx.optimizer.param_groups[0]
    token = ctx.save_checkpoint(full=True)
    for _ in range(2):
        ctx.run_training_epoch(order=ctx.random_order())
        ctx.scheduler.step()
        np.random.rand(3), random.random()
        if device.type == "cuda":
            torch.rand(3, device=device)  # the CUDA generator moves on as well
        ctx.restore_checkpoint(token)
        assert_state_equal(saved, state_of(ctx))
    assert ctx.optimizer.param_groups[0] is group  # live group dicts are kept
    ctx.discard_checkpoint(token)
    with pytest.raises(KeyError, match="no checkpoint with token"):
        ctx.restore_checkpoint(token)


def test_light_checkpoint_restores_model_and_grads_only(device: torch.device) -> None:
    ctx, model, _ = setup(device=device)
    ctx.run_training_epoch()
    params = [p.detach().clone() for p in model.parameters()]
    token = ctx.save_checkpoint(full=False)
    ctx.run_training_epoch()
    step_after = [s["step"].clone() for s in ctx.optimizer.state.values()]
    ctx.restore_checkpoint(token)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert all(
        torch.equal(a, s["step"])
        for a, s in zip(step_after, ctx.optimizer.state.values(), strict=True)
    )


def test_batch_and_full_gradients_match_plain_autograd_and_leave_param_grad_alone(
    device: torch.device,
) -> None:
    ctx, model, data = setup(device=device)
    sentinel = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, s in zip(model.parameters(), sentinel, strict=True):
        p.grad = s.clone()
    first = {"x": data["x"][:4], "y": data["y"][:4]}
    batch_grads = ctx.compute_batch_gradients()
    ref = torch.autograd.grad(mse(model, first), list(model.parameters()))
    full = ctx.compute_gradients()
    # the minibatch-size-weighted mean of minibatch gradients of a mean loss is the full-batch gradient
    ref_full = torch.autograd.grad(mse(model, data), list(model.parameters()))
    for (name, g), r, rf in zip(batch_grads.items(), ref, ref_full, strict=True):
        assert torch.allclose(g, r, atol=1e-7), name
        assert torch.allclose(full[name], rf, atol=1e-6), name
    assert all(torch.equal(p.grad, s) for p, s in zip(model.parameters(), sentinel, strict=True))


def test_run_training_epoch_reproduces_the_loop_it_stands_for(device: torch.device) -> None:
    ctx, model, data = setup(device=device)
    twin = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    order = torch.tensor([7, 2, 9, 0, 4, 1, 8, 3, 6, 5])
    mean_grads = ctx.run_training_epoch(order=order)
    expected = [torch.zeros_like(p) for p in twin.parameters()]
    for idx in torch.split(order.to(device), 4):
        twin_opt.zero_grad()
        mse(twin, {"x": data["x"][idx], "y": data["y"][idx]}).backward()
        for e, p in zip(expected, twin.parameters(), strict=True):
            e.add_(p.grad, alpha=len(idx) / 10)  # before clipping
        nn.utils.clip_grad_norm_(list(twin.parameters()), 0.5)
        twin_opt.step()
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )
    assert all(
        torch.allclose(g, e, atol=1e-7) for g, e in zip(mean_grads.values(), expected, strict=True)
    )


def test_step_false_leaves_parameters_unchanged(device: torch.device) -> None:
    ctx, model, _ = setup(max_grad_norm=None, device=device)
    params = [p.detach().clone() for p in model.parameters()]
    grads = ctx.run_training_epoch(step=False)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    full = ctx.compute_gradients()
    assert all(torch.allclose(grads[n], full[n], atol=1e-7) for n in full)


def test_pre_epoch_state_and_perturbation(device: torch.device) -> None:
    ctx, model, _ = setup(device=device)
    with pytest.raises(RuntimeError, match="needs_pre_epoch_state"):
        ctx.restore_pre_epoch()
    ctx.capture_pre_epoch()
    start = [p.detach().clone() for p in model.parameters()]
    lr = ctx.optimizer.param_groups[0]["lr"]
    ctx.run_training_epoch()
    ctx.scheduler.step()
    ctx.restore_pre_epoch()
    assert all(torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))
    assert ctx.optimizer.param_groups[0]["lr"] == lr
    assert not ctx.optimizer.state  # Adam had taken no step at PRE_EPOCH
    direction = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    ctx.apply_perturbation(direction, 0.25)
    assert all(torch.equal(p, a + 0.25) for a, p in zip(start, model.parameters(), strict=True))
    ctx.apply_perturbation(list(direction.values()), -0.25)
    assert all(torch.allclose(p, a) for a, p in zip(start, model.parameters(), strict=True))
    with pytest.raises(KeyError, match="unknown parameters"):
        ctx.apply_perturbation({"nope": torch.zeros(1)}, 1.0)
    with pytest.raises(ValueError, match="trainable parameters"):
        ctx.apply_perturbation([torch.zeros(1)], 1.0)


def test_minibatch_list_form_orders_and_observations(device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(device)
    batches = [
        {"x": torch.full((2, 3), float(i)).to(device), "y": torch.zeros(2, 2).to(device)}
        for i in range(3)
    ]
    ctx = LoopModelDataContext(
        model, torch.optim.SGD(model.parameters(), lr=0.1), mse, minibatches=batches, obs_key="x"
    )
    assert [int(b["x"][0, 0]) for b in ctx.minibatches([2, 0, 1])] == [2, 0, 1]
    assert sorted(int(b["x"][0, 0]) for b in ctx.get_shuffled_loader()) == [0, 1, 2]
    assert torch.equal(ctx.observations(), torch.cat([b["x"] for b in batches]))
    empty = LoopModelDataContext(model, torch.optim.SGD(model.parameters(), lr=0.1), mse)
    with pytest.raises(RuntimeError, match="set_data"):
        empty.compute_gradients()
    with pytest.raises(ValueError, match="minibatch_size"):
        empty.set_data(data={"x": torch.zeros(2, 3)})
