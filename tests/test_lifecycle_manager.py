"""HookManager dispatch: points, windows, intervention points, namespacing, buffering,
errors, RNG isolation, guardian, demand-driven context."""

from __future__ import annotations

import math
import random
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from policy_probes import ComponentContext
from policy_probes.lifecycle import (
    HookManager,
    HookPoint,
    InterventionHook,
    LoopModelDataContext,
    RunDataContext,
    StepSchedule,
    TrainingHook,
    capture_rng_state,
)
from policy_probes.lifecycle.hooks import DebugCorruptHook

P = HookPoint


class Recorder(TrainingHook):
    name = "rec"
    hook_points = (P.POST_EPOCH,)

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[HookPoint, int, int | None]] = []
        self.seen: list[RunDataContext] = []

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        self.calls.append((ctx.point, ctx.epoch, ctx.step))
        self.seen.append(ctx)
        return {"value": float(ctx.epoch)}


def make_setup(
    hooks: list[TrainingHook], device: torch.device | str = "cpu", **kw: Any
) -> tuple[HookManager, LoopModelDataContext, nn.Module, list[int]]:
    """Model and data built on the CPU from seed 0, then moved to ``device``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = {"x": torch.randn(8, 3).to(device), "y": torch.randn(8, 1).to(device)}

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return (m(b["x"]) - b["y"]).square().mean()

    mctx = LoopModelDataContext(model, opt, loss_fn, data=data, minibatch_size=4, obs_key="x")
    built: list[int] = []

    def factory() -> LoopModelDataContext:
        built.append(1)
        return mctx

    manager = HookManager(
        hooks, model=model, optimizer=opt, component_context=ComponentContext(), **kw, loop="ppo"
    )
    manager.factory = factory  # type: ignore[attr-defined]
    return manager, mctx, model, built


def cuda_rng_states() -> tuple[torch.Tensor, ...]:
    """The CUDA generators' states (none while CUDA is not initialised)."""
    return tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()


def same_states(a: tuple[torch.Tensor, ...] | None, b: tuple[torch.Tensor, ...]) -> bool:
    return a is not None and len(a) == len(b) and all(map(torch.equal, a, b))


def test_no_hooks_returns_at_once_and_builds_nothing(device: torch.device) -> None:
    manager, _, _, built = make_setup([], device)
    assert not manager.active
    for point in P:
        assert manager.fire(point, epoch=0, step=0, model_ctx=manager.factory) == {}
    assert built == []
    assert manager.flush().records == []
    assert (manager.needs_grads, manager.needs_prev_step_grads, manager.needs_pre_epoch_state) == (
        False,
    ) * 3


def test_hooks_fire_only_at_their_points_and_loop_windows() -> None:
    class Windowed(Recorder):
        name = "win"
        hook_points = (P.PRE_STEP,)  # ignored: loop_points decide
        loop_points: ClassVar = {
            "ppo": {P.POST_EPOCH: (1, 2), P.SNAPSHOT: None},
            "external": [P.POST_EPOCH],
        }

    for loop, expected in (
        (
            "ppo",
            [
                (P.POST_EPOCH, 1, None),
                (P.POST_EPOCH, 2, None),
                (P.SNAPSHOT, 0, None),
                (P.SNAPSHOT, 1, None),
                (P.SNAPSHOT, 2, None),
                (P.SNAPSHOT, 3, None),
            ],
        ),
        ("external", [(P.POST_EPOCH, e, None) for e in range(4)]),
        ("other", []),
    ):
        hook = Windowed()
        manager = HookManager([hook], loop=loop)
        for point in (P.POST_EPOCH, P.SNAPSHOT, P.PRE_EPOCH):
            for epoch in range(4):
                manager.fire(point, epoch=epoch)
        assert sorted(hook.calls, key=lambda c: (c[0].name, c[1])) == sorted(
            expected, key=lambda c: (c[0].name, c[1])
        )


def test_step_schedule_and_buffering_flush_once_per_epoch(device: torch.device) -> None:
    class StepHook(TrainingHook):
        name = "stepper"
        hook_points = (P.POST_STEP,)
        step_schedule = StepSchedule.burst(2, 5)

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            # device tensors: flush() brings them to the host in one transfer
            return {
                "x": torch.tensor(float(ctx.step)).to(device),
                "vec": torch.tensor([1.0, float(ctx.step)]).to(device),
                "nested": {"y": 2.0},
            }

    manager = HookManager([StepHook()], loop="ppo")
    for step in range(12):
        assert manager.fire(P.POST_STEP, epoch=0, step=step) == {}  # buffered, not returned
    flushed = manager.flush()
    due = [0, 1, 5, 6, 10, 11]
    assert [r.step for r in flushed.records] == due
    assert all(isinstance(r.metrics["stepper/x"], float) for r in flushed.records)
    assert [r.metrics["stepper/x"] for r in flushed.records] == [float(s) for s in due]
    assert flushed.records[2].metrics["stepper/vec"] == [1.0, 5.0]
    assert flushed.summary["stepper/x"] == pytest.approx(sum(due) / len(due))
    assert flushed.summary["stepper/vec"] == pytest.approx([1.0, sum(due) / len(due)])
    assert flushed.summary["stepper/nested/y"] == 2.0
    assert manager.flush().records == []  # emptied
    with pytest.raises(ValueError, match="step="):
        manager.fire(P.POST_STEP, epoch=0)


def test_metrics_are_namespaced_unless_the_hook_opts_out_and_last_metrics_are_shared() -> None:
    class Raw(TrainingHook):
        name = "raw"
        namespaced = False

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            return {"train/loss": 1.5}

    class Reader(TrainingHook):
        name = "reader"

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            earlier = ctx.last_metrics[P.POST_EPOCH]
            return {"double": 2 * earlier["rec/value"] + earlier["train/loss"]}

    manager = HookManager([Recorder(), Raw(), Reader()], loop="ppo")
    out = manager.fire(P.POST_EPOCH, epoch=3)
    assert out == {"rec/value": 3.0, "train/loss": 1.5, "reader/double": 7.5}
    assert manager.last_metrics[P.POST_EPOCH] == out


def test_interventions_run_only_at_intervention_points_and_model_context_is_built_lazily(
    device: torch.device,
) -> None:
    class Mixed(InterventionHook):
        name = "mixed"
        hook_points = (P.POST_ROLLOUT, P.POST_EPOCH)
        intervention_points = (P.POST_EPOCH,)

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            return {"observed": 1.0}

        def intervene(self, run_ctx: RunDataContext, model_ctx: Any) -> dict[str, Any]:
            return {"intervened": 1.0}

    manager, _, _, built = make_setup([Mixed(), Recorder()], device)
    assert manager.fire(P.POST_ROLLOUT, epoch=0, model_ctx=manager.factory) == {
        "mixed/observed": 1.0
    }
    assert built == []  # no intervention due: no ModelDataContext, no guardian
    out = manager.fire(P.POST_EPOCH, epoch=0, model_ctx=manager.factory)
    assert out == {"rec/value": 0.0, "mixed/intervened": 1.0}
    assert built == [1]
    # an intervention due without a model context is reported, not fatal
    assert manager.fire(P.POST_EPOCH, epoch=1)["mixed/error"] == 1.0


def test_a_raising_hook_is_reported_and_the_others_still_run() -> None:
    class Broken(TrainingHook):
        name = "broken"

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            raise ZeroDivisionError("boom")

    class NotADict(TrainingHook):
        name = "notadict"

        def compute(self, ctx: RunDataContext) -> Any:
            return 3.0

    manager = HookManager([Broken(), NotADict(), Recorder()], loop="ppo")
    for epoch in range(3):
        out = manager.fire(P.POST_EPOCH, epoch=epoch)
        assert out == {"broken/error": 1.0, "notadict/error": 1.0, "rec/value": float(epoch)}
    assert manager.errors == {"broken": 3, "notadict": 3}
    assert "ZeroDivisionError: boom" in manager.error_messages["broken"]
    with pytest.raises(ZeroDivisionError):
        HookManager([Broken()], strict=True, loop="ppo").fire(P.POST_EPOCH, epoch=0)


def test_every_rng_is_restored_after_each_hook_and_phase_is_hook_during_dispatch(
    device: torch.device,
) -> None:
    phases: list[str] = []
    on_cuda = device.type == "cuda"

    class Greedy(TrainingHook):
        name = "greedy"

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            phases.append(ctx.component_context.phase)
            out = {"t": float(torch.rand(())), "n": float(np.random.rand()), "p": random.random()}
            if on_cuda:  # and the CUDA generator
                out["c"] = float(torch.rand((), device=device))
            return out

    cc = ComponentContext()
    manager = HookManager([Greedy()], component_context=cc, loop="ppo")
    if on_cuda:
        torch.zeros((), device=device)  # CUDA initialised: its generator state is captured
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    before = capture_rng_state()
    first = manager.fire(P.POST_EPOCH, epoch=0)
    after = capture_rng_state()
    assert torch.equal(before.torch_cpu, after.torch_cpu)
    assert np.array_equal(before.numpy[1], after.numpy[1]) and before.numpy[2:] == after.numpy[2:]
    assert before.python == after.python
    if on_cuda:
        assert same_states(before.torch_cuda, cuda_rng_states())
        assert same_states(after.torch_cuda, cuda_rng_states())
    # the hook drew real numbers: the same ones the generators give right now
    expected = {
        "greedy/t": float(torch.rand(())),
        "greedy/n": float(np.random.rand()),
        "greedy/p": random.random(),
    }
    if on_cuda:
        expected["greedy/c"] = float(torch.rand((), device=device))
    assert first == expected
    assert phases == ["hook"] and cc.phase == "train"


def test_guardian_restores_model_optimizer_grads_rng_even_when_the_intervention_raises(
    device: torch.device,
) -> None:
    manager, mctx, model, _ = make_setup([DebugCorruptHook()], device)
    opt = mctx.optimizer
    for _ in range(2):
        mctx.run_training_epoch()
    mctx.compute_loss().backward()  # leave gradients in place
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    opt_state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    lr_group = opt.param_groups[0]
    rng = capture_rng_state()
    cuda_rng = cuda_rng_states()
    out = manager.fire(P.POST_EPOCH, epoch=0, model_ctx=mctx)
    assert out == {"debug_corrupt/error": 1.0}
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    live = opt.state[next(model.parameters())]
    assert all(torch.equal(opt_state[k], live[k]) for k in opt_state)
    assert opt.param_groups[0] is lr_group and lr_group["lr"] == 1e-2
    assert torch.equal(rng.torch_cpu, torch.get_rng_state())
    if device.type == "cuda":  # the hook drew from the CUDA generator and reseeded it
        assert same_states(rng.torch_cuda, cuda_rng) and same_states(
            rng.torch_cuda, cuda_rng_states()
        )
    assert model.training


def test_the_debug_hook_really_corrupts_everything_when_run_without_a_guardian(
    device: torch.device,
) -> None:
    manager, mctx, model, _ = make_setup([], device)
    mctx.run_training_epoch()
    opt = mctx.optimizer
    params = [p.detach().clone() for p in model.parameters()]
    exp_avg = opt.state[next(model.parameters())]["exp_avg"].clone()
    rng = capture_rng_state()
    ctx = RunDataContext(point=P.POST_EPOCH, epoch=0, model=model, optimizer=opt, loop="ppo")
    with pytest.raises(RuntimeError, match="deliberate"):
        DebugCorruptHook().intervene(ctx, mctx)
    assert torch.isnan(next(model.parameters())).all()
    assert not any(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert not torch.equal(exp_avg, opt.state[next(model.parameters())]["exp_avg"])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 1000)
    assert not torch.equal(rng.torch_cpu, torch.get_rng_state())
    if device.type == "cuda":
        assert rng.torch_cuda is not None and not same_states(rng.torch_cuda, cuda_rng_states())
    assert not model.training


def test_demand_driven_grads_prev_step_grads_and_pre_epoch_state(device: torch.device) -> None:
    class GradReader(TrainingHook):
        name = "gradreader"
        hook_points = (P.PRE_STEP, P.POST_EPOCH)
        needs_grads = True
        needs_prev_step_grads = True
        needs_pre_epoch_state = True

        def __init__(self) -> None:
            super().__init__()
            self.log: list[tuple[HookPoint, Any, Any]] = []

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            snap = lambda g: None if g is None else {k: v.clone() for k, v in g.items()}  # noqa: E731
            self.log.append((ctx.point, snap(ctx.grads), snap(ctx.prev_step_grads)))
            return {}

    hook = GradReader()
    manager, mctx, model, built = make_setup([hook], device)
    assert (manager.needs_grads, manager.needs_prev_step_grads, manager.needs_pre_epoch_state) == (
        True,
    ) * 3
    manager.fire(P.PRE_EPOCH, epoch=0, model_ctx=manager.factory)
    assert built == [1]  # the pre-epoch state was captured through the model context
    start = [p.detach().clone() for p in model.parameters()]
    step_grads = []
    for step, batch in enumerate(mctx.minibatches()):
        mctx.optimizer.zero_grad()
        mctx.loss(batch).backward()
        step_grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        manager.fire(P.PRE_STEP, epoch=0, step=step)
        mctx.optimizer.step()
    manager.fire(P.POST_EPOCH, epoch=0)
    (p0, g0, prev0), (p1, g1, prev1), (pe, ge, _) = hook.log
    assert (p0, p1, pe) == (P.PRE_STEP, P.PRE_STEP, P.POST_EPOCH)
    for n in step_grads[0]:
        assert torch.equal(g0[n], step_grads[0][n]) and torch.equal(g1[n], step_grads[1][n])
        assert torch.equal(prev1[n], step_grads[0][n])
        assert torch.allclose(ge[n], (step_grads[0][n] + step_grads[1][n]) / 2)
    assert prev0 is None
    mctx.restore_pre_epoch()
    assert all(torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))


def test_offload_moves_hook_state_to_cpu_between_firings(device: torch.device) -> None:
    moves: list[str] = []

    class Stateful(Recorder):
        name = "stateful"

        def move_state(self, device: Any) -> None:
            moves.append(str(device))
            super().move_state(device)

    hook = Stateful()
    hook.state["buf"] = torch.ones(3)
    model = nn.Linear(2, 2).to(device)
    manager = HookManager([hook], offload_state=True, model=model, loop="ppo")
    manager.fire(P.POST_EPOCH, epoch=0)
    model_device = str(next(model.parameters()).device)
    assert moves == ["cpu", model_device, "cpu"]  # at start, to the model device, back to cpu
    assert hook.state["buf"].device.type == "cpu"


def test_unknown_fields_and_duplicate_hooks_are_clear_errors() -> None:
    manager = HookManager([Recorder()], loop="ppo")
    with pytest.raises(TypeError, match="unexpected field.*'lossy'.*accepts"):
        manager.fire(P.POST_EPOCH, epoch=0, lossy=1.0)
    with pytest.raises(TypeError, match="'grads'"):
        manager.fire(P.POST_EPOCH, epoch=0, grads={})
    with pytest.raises(ValueError, match="selected twice"):
        HookManager([Recorder(), Recorder()], loop="ppo")


def test_epoch_point_values_reach_the_host_as_python_numbers(device: torch.device) -> None:
    class Tensors(TrainingHook):
        name = "tensors"

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            return {
                "scalar": torch.tensor(2.5).to(device),
                "vector": torch.arange(3.0).to(device),
                "np": np.float32(1.5),
            }

    out = HookManager([Tensors()], loop="ppo").fire(P.POST_EPOCH, epoch=0)
    assert out == {"tensors/scalar": 2.5, "tensors/vector": [0.0, 1.0, 2.0], "tensors/np": 1.5}
    assert type(out["tensors/np"]) is float and not math.isnan(out["tensors/scalar"])


def test_hooks_that_do_not_run_the_model_leave_the_probe_phase_alone() -> None:
    seen: list[str] = []
    changes: list[str] = []

    class ReadsStateOnly(TrainingHook):
        name = "reads_state"
        runs_model = False

        def compute(self, ctx: RunDataContext) -> dict[str, Any]:
            seen.append(ctx.component_context.phase)
            return {"x": 1.0}

    cc = ComponentContext()
    cc.add_phase_listener(changes.append)
    HookManager([ReadsStateOnly()], component_context=cc, loop="ppo").fire(P.POST_EPOCH, epoch=0)
    assert seen == ["train"] and changes == []  # no disarm/re-arm of the probes' hooks
    seen.clear()

    class RunsModel(ReadsStateOnly):
        name = "runs_model"
        runs_model = True

    HookManager([ReadsStateOnly(), RunsModel()], component_context=cc, loop="ppo").fire(
        P.POST_EPOCH, epoch=0
    )
    assert seen == ["hook", "hook"] and changes == ["hook", "train"]
