"""Probe hooks never synchronise with the host: no .item(), .cpu(), .tolist(), .numpy()
or Python scalar conversion of a tensor inside a forward or backward hook; on CUDA, no
synchronising CUDA operation at all (``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy, attach_all_probes
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeSettings,
    Run,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)

SYNCING = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}
#: functions of the toolkit that read a value back from a CPU tensor only (the row
#: buffer's finiteness check, which on the CPU synchronises nothing): their reads of a CPU
#: tensor are not recorded; a read of a device tensor is
CPU_READERS = frozenset({"_finite_on_cpu"})


#: what torch raises for a synchronising CUDA operation under sync debug mode "error"
CUDA_SYNC_ERROR = "called a synchronizing CUDA operation"


class ForbidHostSync:
    """Records every call of a tensor method that moves data to the host, wherever it
    happens: wraps the methods on ``torch.Tensor`` itself, so calls inside backward hooks
    (run by the autograd engine, where torch-function modes are not active) are seen too.

    With a CUDA ``device``, CUDA's own check is on as well: every synchronising CUDA
    operation (a copy between host and device included, whichever call makes it) raises
    (``torch.cuda.set_sync_debug_mode("error")``, process-wide, so in the autograd
    engine's threads too); the previous mode comes back at the exit. Inputs are therefore
    moved to the device before the block.

    ``host_readers``: names of functions whose calls are not recorded, because what they
    read is a host tensor on every device (a seed drawn from a CPU generator); the
    functions in :data:`CPU_READERS` are not recorded when they read a CPU tensor."""

    def __init__(
        self, device: torch.device | None = None, host_readers: frozenset[str] = frozenset()
    ) -> None:
        self.calls: list[str] = []
        self.saved: dict[str, object] = {}
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.sync_mode: int | None = None
        self.host_readers = host_readers

    def __enter__(self) -> ForbidHostSync:
        for name in SYNCING:
            original = getattr(torch.Tensor, name)
            self.saved[name] = torch.Tensor.__dict__.get(name)

            def wrapper(t, *args, _name=name, _orig=original, **kwargs):  # noqa: ANN001
                caller = sys._getframe(1).f_code.co_name
                cpu_read = caller in CPU_READERS and t.device.type == "cpu"
                if caller not in self.host_readers and not cpu_read:
                    self.calls.append(_name)
                return _orig(t, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        if self.cuda:
            self.sync_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sync_mode is not None:
            torch.cuda.set_sync_debug_mode(self.sync_mode)
            self.sync_mode = None
        for name, saved in self.saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def minibatches(
    steps: int = 3, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` minibatches drawn on the CPU from the global generator (the same values on
    every device), moved to ``device`` before a block that forbids host syncs (a copy to
    the device is one)."""
    batches = [(torch.randn(16, 5), torch.randint(0, 3, (16,))) for _ in range(steps)]
    return [(x.to(device), a.to(device)) for x, a in batches]


def train_steps(policy: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, a in batches:
        F.cross_entropy(policy(x), a).backward()


def cuda_sync_raises(device: torch.device) -> contextlib.AbstractContextManager:
    """Around a pass whose hook syncs on purpose: on CUDA, CUDA's check raises there."""
    if device.type == "cuda":
        return pytest.raises(RuntimeError, match=CUDA_SYNC_ERROR)
    return contextlib.nullcontext()


@pytest.mark.parametrize("buffer_rows", [2048, 20])
def test_all_probes_run_without_host_sync(buffer_rows: int, device: torch.device) -> None:
    # 20 rows: the buffers fill up every other step, so the drains (every tracker's
    # reductions) run inside the hooks too
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    x = torch.randn(4, 5).to(device)
    batches = minibatches(5, device)
    with ForbidHostSync(device) as baseline:  # the bare model: its own forward/backward
        policy.remove_hooks()
        train_steps(policy, batches)
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    for tracker in ctx.model_metrics.values():
        tracker.buffer_rows = buffer_rows
    batches = minibatches(5, device)
    with ForbidHostSync(device) as probed:
        train_steps(policy, batches)
    assert baseline.calls == []
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()  # the one transfer per window happens here
    assert metrics["probes/fisher/actor_mlp/samples"] == 80
    assert metrics["probes/relu/actor_mlp/samples"] == 80
    assert policy(x).shape == (4, 3)


@pytest.mark.parametrize(
    ("buffer_elements", "masked"), [(1 << 20, False), (300, False), (300, True)]
)
def test_conv_and_per_layer_probes_run_without_host_sync(
    buffer_elements: int, masked: bool, device: torch.device
) -> None:
    # channels-first views of conv outputs, per-layer hooks on every ReLU of the encoder
    # and of the MLP trunk; 300 elements: drains (the strided row copies) inside the hooks;
    # masked: every other sample left out (mask rows expanded over conv positions)
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 3, 1), nn.Tanh())
    model = nn.Sequential(encoder, nn.Flatten(), nn.Linear(3 * 16, 8), nn.ReLU(), nn.Linear(8, 3))
    model.to(device)
    policy = PolicyAutoBuilder.wrap(model, {"encoder": "0", "trunk": model})
    ctx = ComponentContext()
    for name in ("encoder", "trunk"):
        policy.attach(name, attach_relu_activation_hooks(), ctx)
        policy.attach(name, attach_saturated_activation_hooks("tanh"), ctx)
        policy.attach(name, attach_gradient_flow_hooks(), ctx, backward=True)
        policy.attach(name, attach_relu_gradient_flow_hooks(), ctx, backward=True)
    for tracker in ctx.model_metrics.values():
        tracker.buffer_elements = buffer_elements
    g = torch.Generator().manual_seed(1)
    passes = []
    for n in (5, 3, 6):
        x, a = torch.randn(n, 2, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        mask = (torch.arange(n) % 2 == 0).float().to(device) if masked else None
        passes.append((x.to(device), a.to(device), mask))
    with ForbidHostSync(device) as probed:
        for x, a, mask in passes:
            ctx.row_mask = mask
            F.cross_entropy(policy(x), a).backward()
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()
    assert not [k for k in metrics if k.startswith("probes/errors/")]
    assert len(metrics["probes/relu/encoder.1/active_rate"]) == 4  # channels
    assert metrics["probes/relu/encoder.1/samples"] == (8 if masked else 14)  # batch rows
    assert metrics["probes/gradient_flow/trunk.0.1/passes"] == 3
    assert len(metrics["probes/saturation_tanh/encoder/saturation_rate"]) == 3
    assert len(metrics["probes/relu_gradient_flow/trunk.3/pass_rate"]) == 8


def test_the_detector_catches_a_syncing_hook(device: torch.device) -> None:
    """Positive control: a hook that calls .item() is seen by the detector (on CUDA by
    CUDA's check too, which raises before the hook gets the value)."""
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    seen = []
    policy.actor_mlp.register_forward_hook(lambda m, i, o: seen.append(o.sum().item()))
    batches = minibatches(1, device)
    with ForbidHostSync(device) as mode, cuda_sync_raises(device):
        train_steps(policy, batches)
    assert mode.calls == ["item"]
    assert len(seen) == (0 if device.type == "cuda" else 1)


@pytest.mark.parametrize("backward", [False, True])
def test_detector_sees_calls_inside_backward_hooks(backward: bool, device: torch.device) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    seen: list = []
    if backward:
        policy.actor_mlp.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].tolist()))
    else:
        policy.actor_mlp.register_forward_hook(lambda m, i, o: seen.append(o.tolist()))
    batches = minibatches(1, device)
    with ForbidHostSync(device) as mode, cuda_sync_raises(device):
        train_steps(policy, batches)
    assert mode.calls == ["tolist"]
    assert len(seen) == (0 if device.type == "cuda" else 1)


@pytest.mark.parametrize("buffer_rows", [2048, 5])
def test_masked_rows_and_recurrent_cores_run_without_host_sync(
    buffer_rows: int, device: torch.device
) -> None:
    """Row masks (flat on an MLP; (batch, time) on an LSTM called at once and per step,
    and on an LSTM cell) add no host synchronisation, drains inside the hooks included."""
    from test_recurrent import SeqNet, masked_mean_loss, sequences

    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    nets = [SeqNet("lstm").to(device), SeqNet("lstm_cell").to(device)]
    for i, net in enumerate(nets):
        wrapped = PolicyAutoBuilder.wrap(net, {f"core{i}": "core"})
        wrapped.attach(f"core{i}", attach_relu_activation_hooks(), ctx)
        wrapped.attach(f"core{i}", attach_saturated_activation_hooks("tanh"), ctx)
        for make in (attach_fisher_information_hooks, attach_gradient_flow_hooks):
            wrapped.attach(f"core{i}", make(), ctx, backward=True)
    for tracker in ctx.model_metrics.values():
        tracker.buffer_rows = buffer_rows
    x, a, mask = (t.to(device) for t in sequences())
    masks = [(torch.arange(16) % 3 != 0).float().to(device) for _ in range(5)]
    batches = minibatches(len(masks), device)
    with ForbidHostSync(device) as probed:
        for m, (x1, a1) in zip(masks, batches, strict=True):
            ctx.row_mask = m
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


def test_key_and_index_extractors_on_tensordict_and_tuple_outputs_run_without_host_sync(
    device: torch.device,
) -> None:
    import tensordict
    from tensordict.nn import TensorDictModule

    class Pair(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return h, h.sum(-1)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU()).to(device)
    body = TensorDictModule(net, in_keys=["obs"], out_keys=[("next", "hidden")])
    pair, head = Pair(), torch.nn.Linear(6, 3).to(device)
    model = PolicyAutoBuilder.wrap(torch.nn.ModuleDict({"body": body, "pair": pair, "head": head}))
    ctx = ComponentContext()
    key = ("next", "hidden")
    model.attach("body", attach_relu_activation_hooks(), ctx, extractor=key)
    model.attach("body", attach_fisher_information_hooks(), ctx, backward=True, extractor=key)
    model.attach("pair", attach_gradient_flow_hooks(), ctx, backward=True, extractor=0)
    inputs = [
        (tensordict.TensorDict({"obs": obs}, batch_size=[16]), a)
        for obs, a in minibatches(3, device)  # randn(16, 5), randint(0, 3, (16,)) per pass
    ]
    with ForbidHostSync(device) as probed:
        for td, a in inputs:
            h = pair(body(td)["next", "hidden"])[0]
            F.cross_entropy(head(h), a).backward()
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()
    assert metrics["probes/relu/body/samples"] == 48
    assert metrics["probes/fisher/body/samples"] == 48
    assert metrics["probes/gradient_flow/pair/passes"] == 3


def test_phase_inference_runs_without_host_sync(device: torch.device) -> None:
    """A loop that set no phase (``infer_phase``, as a ProbeSession before set_phase):
    forwards under no_grad / inference_mode are skipped by a flag check, training
    passes are recorded, and neither touches the host."""
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    ctx.infer_phase = True
    attach_all_probes(policy, ctx)
    x7, x9 = torch.randn(7, 5).to(device), torch.randn(9, 5).to(device)
    batches = minibatches(2, device)
    with ForbidHostSync(device) as probed:
        with torch.no_grad():
            policy(x7)
        with torch.inference_mode():
            policy(x9)
        train_steps(policy, batches)
    assert probed.calls == []
    assert not ctx.probe_errors
    metrics = StatsReporter(ctx).collect()
    assert metrics["probes/relu/actor_mlp/samples"] == 32  # the two training passes only
    assert metrics["probes/fisher/actor_mlp/samples"] == 32
    # control: with the phase set explicitly ("train"), the no_grad forwards count too
    policy.remove_hooks()
    ctx = ComponentContext()
    attach_all_probes(policy, ctx)
    with torch.no_grad():
        policy(torch.randn(7, 5).to(device))
    train_steps(policy, minibatches(2, device))
    assert StatsReporter(ctx).collect()["probes/relu/actor_mlp/samples"] == 32 + 7


class ConvLSTMBody(nn.Module):
    """A conv encoder (closed-form conv and GroupNorm rules) feeding an LSTM (generic
    route, gate-gradient rule), a GRU cell (generic route through torch.func) and a
    Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten()
        )
        self.lstm = nn.LSTM(64, 6, batch_first=True)
        self.cell = nn.GRUCell(6, 6)
        self.out = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t = x.shape[:2]
        feats = self.conv(x.reshape(n * t, *x.shape[2:])).reshape(n, t, -1)
        out, _ = self.lstm(feats)
        return torch.tanh(self.out(self.cell(out[:, -1], out[:, 0])))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("buffer_rows", [2048, 20])
def test_conv_and_lstm_fisher_run_without_host_sync(
    buffer_rows: int, masked: bool, device: torch.device
) -> None:
    """The closed-form, gate-gradient and torch.func routes, also under a (batch, time)
    row mask (per frame on the conv rules, per sequence on the LSTM, one column on the
    cell and the Linear)."""
    torch.manual_seed(0)
    body = ConvLSTMBody()
    model = PolicyAutoBuilder.wrap(nn.Sequential(body, nn.Linear(5, 3)).to(device), {"body": "0"})
    ctx = ComponentContext()
    model.attach("body", attach_fisher_information_hooks(chunk_bytes=4096), ctx, backward=True)
    ctx.model_metrics["fisher"].buffer_rows = buffer_rows
    passes = []
    for _ in range(4):
        x, a = torch.randn(8, 3, 2, 9, 9), torch.randint(0, 3, (8,))
        mask = (torch.arange(24).reshape(8, 3) % 4 != 1).float().to(device) if masked else None
        passes.append((x.to(device), a.to(device), mask))
    with ForbidHostSync(device) as probed:
        for x, a, mask in passes:
            if masked:
                ctx.row_mask = mask
            F.cross_entropy(model(x), a).backward()
        ctx.row_mask = None
    assert probed.calls == []
    assert not ctx.probe_errors
    fisher = ctx.model_metrics["fisher"].param_fisher("body")
    metrics = StatsReporter(ctx).collect()
    assert metrics["probes/fisher/body/unsupported_params"] == 0
    assert set(fisher) == {n for n, _ in body.named_parameters()}
    assert all(v.sum() > 0 for v in fisher.values())


def test_session_step_points_run_without_host_sync(tmp_path, device: torch.device) -> None:
    """The step path every driver takes (the built-in trainer's minibatch loop included):
    ``session.pre_step`` / ``post_step`` with a step-point hook selected buffer the
    hook's metrics on the device; the host sees them once, at ``epoch_end``."""
    from policy_probes import ProbeSession
    from policy_probes.sinks import SinksConfig, WandbConfig

    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-3)  # Adam's step reads its count
    with ProbeSession(
        policy,
        optimizer=opt,
        run=Run(tmp_path),
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, csv=False, wandb=False),
            wandb=WandbConfig(mode="disabled"),
            hooks=["norms"],
            probe_budget=None,
        ),
    ) as session:
        attach_all_probes(policy, session.context)
        session.set_phase("train")
        grads = []
        batches = minibatches(3, device)
        with ForbidHostSync(device) as probed:
            for step, (x, a) in enumerate(batches):
                loss = F.cross_entropy(policy(x), a)
                opt.zero_grad()
                loss.backward()
                session.pre_step(loss=loss, step=step, update_epoch=0, minibatch=step)
                opt.step()
                session.post_step(step=step)
                grads.append(torch.cat([p.grad.reshape(-1) for p in policy.parameters()]))
        assert probed.calls == []
        assert not session.context.probe_errors
        metrics = session.epoch_end(step=48)
    assert session.optimizer_step == 3
    assert metrics["probes/relu/actor_mlp/samples"] == 48
    # norms' PRE_STEP gradient norm, averaged over the epoch's steps
    expected = sum(float(g.norm()) for g in grads) / len(grads)
    assert metrics["norms/grad_norm"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("buffer_rows", [2048, 20])
def test_plain_registered_closures_run_without_host_sync(
    buffer_rows: int, device: torch.device
) -> None:
    """Closures registered directly with register_forward_hook / register_full_backward_hook
    (tests/test_plain_closure.py): their first-call check and every later call, drains
    inside the hooks included, add no host synchronisation."""
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    mlp, head = policy.actor_mlp, policy.actor_head
    relu = attach_relu_activation_hooks()
    mlp.register_forward_hook(relu("actor_mlp", ctx, relu.place(per_layer=False)))
    flow = attach_gradient_flow_hooks()
    closures = [
        flow("actor_mlp", ctx, flow.place(per_layer=False)),
        attach_fisher_information_hooks()("actor_mlp", ctx),
        attach_relu_gradient_flow_hooks()("actor_mlp", ctx),
    ]
    handles = [h for c in closures[1:] for h in c.attach(mlp)]  # per-parameter, ReLU hooks
    for closure in closures:
        mlp.register_full_backward_hook(closure)
    head.register_full_backward_hook(attach_gradient_flow_hooks()("actor_head", ctx))
    for tracker in ctx.model_metrics.values():
        tracker.buffer_rows = buffer_rows
    batches = minibatches(5, device)
    with ForbidHostSync(device) as probed:
        train_steps(policy, batches)
    metrics = StatsReporter(ctx).collect()
    assert (probed.calls, ctx.probe_errors, len(handles) > 0) == ([], {}, True)
    assert metrics["probes/relu/actor_mlp/samples"] == metrics["probes/fisher/actor_mlp/samples"]
    assert metrics["probes/relu/actor_mlp/samples"] == 80
    assert metrics["probes/gradient_flow/actor_head/passes"] == 5
    assert len(metrics["probes/relu_gradient_flow/actor_mlp.layer_1/pass_rate"]) == 6


@pytest.mark.parametrize("schedule", ["every_k:2", "budget"])
def test_sampled_passes_and_their_boundaries_run_without_host_sync(
    schedule: str, device: torch.device
) -> None:
    """The sampler's pass boundary (the optimizer's step post-hook: accounting, re-arming)
    and the timed hook bodies stay on the host side of the device too."""
    from policy_probes.sampling import Sampler

    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    sampler = Sampler(ctx, schedule=schedule, budget=0.05)
    attach_all_probes(policy, ctx, saturation="tanh", saturation_component="actor_mlp.layer_0")
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    sampler.watch_optimizer(opt)
    batches = minibatches(6, device)
    with ForbidHostSync(device) as probed:
        for x, a in batches:
            opt.zero_grad()
            F.cross_entropy(policy(x), a).backward()
            opt.step()
    assert probed.calls == []
    assert not ctx.probe_errors
    assert sampler.passes == 6
    passes = {k: p for k, (p, _) in sampler.totals().items()}
    assert passes["relu/actor_mlp"] == (3 if schedule == "every_k:2" else 1)  # k=8 at first
