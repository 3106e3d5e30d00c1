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


@pytest.mark.parametrize("buffer_rows", [2048, 5])
def test_masked_rows_and_recurrent_cores_run_without_host_sync(buffer_rows: int) -> None:
    """Row masks (flat on an MLP; (batch, time) on an LSTM called at once and per step,
    and on an LSTM cell) add no host synchronisation, drains inside the hooks included."""
    from test_recurrent import SeqNet, masked_mean_loss, sequences

    from policy_probes import (
        PolicyAutoBuilder,
        attach_fisher_information_hooks,
        attach_gradient_flow_hooks,
        attach_relu_activation_hooks,
        attach_saturated_activation_hooks,
    )

    torch.manual_seed(0)
    policy = TinyPolicy()
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    nets = [SeqNet("lstm"), SeqNet("lstm_cell")]
    for i, net in enumerate(nets):
        wrapped = PolicyAutoBuilder.wrap(net, {f"core{i}": "core"})
        wrapped.attach(f"core{i}", attach_relu_activation_hooks(), ctx)
        wrapped.attach(f"core{i}", attach_saturated_activation_hooks("tanh"), ctx)
        for make in (attach_fisher_information_hooks, attach_gradient_flow_hooks):
            wrapped.attach(f"core{i}", make(), ctx, backward=True)
    for tracker in ctx.model_metrics.values():
        tracker.buffer_rows = buffer_rows
    x, a, mask = sequences()
    masks = [(torch.arange(16) % 3 != 0).float() for _ in range(5)]
    with ForbidHostSync() as probed:
        for m in masks:
            ctx.row_mask = m
            x1, a1 = torch.randn(16, 5), torch.randint(0, 3, (16,))
            (F.cross_entropy(policy(x1), a1, reduction="none") * m).sum().div(10).backward()
        for per_step in (False, True):
            for net in nets:
                net.per_step = per_step
                ctx.row_mask = mask
                masked_mean_loss(net(x), a, mask).backward()
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()
    assert metrics["probes/relu/actor_mlp/samples"] == 5 * 10
    assert metrics["probes/fisher/actor_mlp/samples"] == 5 * 10
    assert metrics["probes/relu/core0/samples"] == 2 * int(mask.sum())
    assert metrics["probes/fisher/core1/samples"] == 2 * int(mask.sum())
