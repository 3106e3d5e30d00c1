"""The conv Fisher's memory on a NatureCNN batch (1024 frames on CUDA, 256 on the CPU).

Per-sample weight gradients of the whole batch would take ``batch x parameters`` floats
(6.9 GB for NatureCNN's 1.68 M parameters at 1024 frames). The probe instead holds each
probed layer's input and output gradient until the report (what autograd saves for the
backward anyway, plus the gradients) and squares per-sample gradients chunk by chunk. The
stated bound (docs/probes/fisher.md, "Memory"): a probed training step plus its report
allocate at most ``4 x held + 2 x chunk`` bytes more at their peak than the bare step,
where ``held`` is the bytes of every probed layer's input and output over the batch and
``chunk`` the conv rule's chunk bound. Peaks are read from the CUDA caching allocator, and
on the CPU from the profiler's allocation events."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    StatsReporter,
    attach_fisher_information_hooks,
)
from policy_probes.probes.fisher_rules import chunk_bytes_for
from trainers.nature_cnn import NatureCNN

FRAMES = (4, 84, 84)


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # allocations are charged to the op that made them, frees are "[memory]" events
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    now = peak = 0
    for event in events:
        now += event.self_cpu_memory_usage
        peak = max(peak, now)
    return peak


def held_bytes(encoder: NatureCNN, x: torch.Tensor) -> int:
    """Bytes of every conv and linear layer's input and output over the batch (float32),
    read by plain forward hooks."""
    sizes: list[int] = []
    handles = [
        m.register_forward_hook(lambda m, i, o: sizes.append(i[0].numel() + o.numel()))
        for m in encoder.modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    with torch.no_grad():
        encoder(x)
    for h in handles:
        h.remove()
    assert len(sizes) == 4  # three convs and the fc layer
    return 4 * sum(sizes)


def test_conv_fisher_on_a_nature_cnn_batch_stays_within_its_memory_bound(
    device: torch.device,
) -> None:
    n = 1024 if device.type == "cuda" else 256
    torch.manual_seed(0)
    net = nn.Sequential(NatureCNN(FRAMES), nn.Linear(512, 6)).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (n, *FRAMES), generator=g, dtype=torch.uint8).to(device)
    a = torch.randint(0, 6, (n,), generator=g).to(device)

    def step(model: nn.Module) -> None:
        for p in net.parameters():
            p.grad = None
        F.cross_entropy(model(x), a).backward()

    step(net)  # warm-up: kernels chosen, workspaces made, before either measurement
    bare = peak_bytes(lambda: step(net), device)
    model = PolicyAutoBuilder.wrap(
        net, {"encoder": "0", "head": "1"}, example_inputs=(torch.zeros(1, *FRAMES, device=device),)
    )
    ctx = ComponentContext()
    model.attach("encoder", attach_fisher_information_hooks(), ctx, backward=True)
    metrics: dict = {}

    def probed() -> None:
        step(model)
        metrics.update(StatsReporter(ctx).collect())

    probed_peak = peak_bytes(probed, device)
    held = held_bytes(net[0], x)
    bound = 4 * held + 2 * chunk_bytes_for(None, device)
    extra = probed_peak - bare
    print(
        f"\n{device}: {n} frames, bare step peak {bare / 2**20:.0f} MiB, probed step + report "
        f"{probed_peak / 2**20:.0f} MiB, extra {extra / 2**20:.0f} MiB = {extra / held:.2f} x held "
        f"({held / 2**20:.0f} MiB); bound {bound / 2**20:.0f} MiB"
    )
    assert extra <= bound
    # the report covers every parameter of the encoder, each with a finite positive trace
    params = dict(net[0].named_parameters())
    traces = {k: v for k, v in metrics.items() if k.endswith(".trace") and "/encoder" in k}
    assert len(traces) == len(params)
    assert all(math.isfinite(v) and v > 0 for v in traces.values())
    # what the bound is for: one batch of per-sample gradients of every parameter
    naive = 4 * n * sum(p.numel() for p in params.values())
    assert bound < naive / 4
