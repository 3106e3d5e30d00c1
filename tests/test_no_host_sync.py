"""Probe hooks never synchronise with the host: no .item(), .cpu(), .tolist(), .numpy()
or Python scalar conversion of a tensor inside a forward or backward hook."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy, attach_all_probes

from policy_probes import (
    ComponentContext,
    StatsReporter,
)

SYNCING = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}


class ForbidHostSync:
    """Records every call of a tensor method that moves data to the host, wherever it
    happens: wraps the methods on ``torch.Tensor`` itself, so calls inside backward hooks
    (run by the autograd engine, where torch-function modes are not active) are seen too."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.saved: dict[str, object] = {}

    def __enter__(self) -> ForbidHostSync:
        for name in SYNCING:
            original = getattr(torch.Tensor, name)
            self.saved[name] = torch.Tensor.__dict__.get(name)

            def wrapper(t, *args, _name=name, _orig=original, **kwargs):  # noqa: ANN001
                self.calls.append(_name)
                return _orig(t, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, saved in self.saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def train_steps(policy: TinyPolicy, steps: int = 3) -> None:
    for _ in range(steps):
        x, a = torch.randn(16, 5), torch.randint(0, 3, (16,))
        F.cross_entropy(policy(x), a).backward()


@pytest.mark.parametrize("buffer_rows", [2048, 20])
def test_all_probes_run_without_host_sync(buffer_rows: int) -> None:
    # 20 rows: the buffers fill up every other step, so the drains (every tracker's
    # reductions) run inside the hooks too
    torch.manual_seed(0)
    policy = TinyPolicy()
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    x = torch.randn(4, 5)
    with ForbidHostSync() as baseline:  # the bare model: its own forward/backward
        policy.remove_hooks()
        train_steps(policy, steps=5)
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    for tracker in ctx.model_metrics.values():
        tracker.buffer_rows = buffer_rows
    with ForbidHostSync() as probed:
        train_steps(policy, steps=5)
    assert baseline.calls == []
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()  # the one transfer per window happens here
    assert metrics["probes/fisher/actor_mlp/samples"] == 80
    assert metrics["probes/relu/actor_mlp/samples"] == 80
    assert policy(x).shape == (4, 3)


def test_the_detector_catches_a_syncing_hook() -> None:
    """Positive control: a hook that calls .item() is seen by the detector."""
    torch.manual_seed(0)
    policy = TinyPolicy()
    seen = []
    policy.actor_mlp.register_forward_hook(lambda m, i, o: seen.append(o.sum().item()))
    with ForbidHostSync() as mode:
        train_steps(policy, steps=1)
    assert mode.calls == ["item"]
    assert len(seen) == 1


@pytest.mark.parametrize("backward", [False, True])
def test_detector_sees_calls_inside_backward_hooks(backward: bool) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy()
    seen: list = []
    if backward:
        policy.actor_mlp.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].tolist()))
    else:
        policy.actor_mlp.register_forward_hook(lambda m, i, o: seen.append(o.tolist()))
    with ForbidHostSync() as mode:
        train_steps(policy, steps=1)
    assert mode.calls == ["tolist"]
    assert len(seen) == 1


def test_phase_inference_runs_without_host_sync() -> None:
    """A loop that set no phase (``infer_phase``, as a ProbeSession before set_phase):
    forwards under no_grad / inference_mode are skipped by a flag check, training
    passes are recorded, and neither touches the host."""
    torch.manual_seed(0)
    policy = TinyPolicy()
    ctx = ComponentContext()
    ctx.infer_phase = True
    attach_all_probes(policy, ctx)
    with ForbidHostSync() as probed:
        with torch.no_grad():
            policy(torch.randn(7, 5))
        with torch.inference_mode():
            policy(torch.randn(9, 5))
        train_steps(policy, steps=2)
    assert probed.calls == []
    metrics = StatsReporter(ctx).collect()
    assert metrics["probes/relu/actor_mlp/samples"] == 32  # the two training passes only
    assert metrics["probes/fisher/actor_mlp/samples"] == 32
    # control: with the phase set explicitly ("train"), the no_grad forwards count too
    policy.remove_hooks()
    ctx = ComponentContext()
    attach_all_probes(policy, ctx)
    with torch.no_grad():
        policy(torch.randn(7, 5))
    train_steps(policy, steps=2)
    assert StatsReporter(ctx).collect()["probes/relu/actor_mlp/samples"] == 32 + 7
