"""Tracker state is sums and counts: all-reduced across two real gloo processes, the
metrics equal a single-process computation over the union of both ranks' samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import TinyPolicy, attach_all_probes

from policy_probes import (
    ComponentContext,
    StatsReporter,
)

UNION_KEYS = (
    "probes/relu/actor_mlp/active_rate",
    "probes/relu/actor_mlp/dead_fraction",
    "probes/relu/actor_mlp/dormant_fraction",
    "probes/relu/actor_mlp/zero_fraction",
    "probes/relu/actor_mlp/samples",
    "probes/fisher/actor_mlp/unit",
    "probes/fisher/actor_mlp/trace",
    "probes/fisher/actor_mlp/max",
    "probes/fisher/actor_mlp/dead_param_fraction",
    "probes/relu_gradient_flow/actor_mlp/pass_rate",
)


def rank_batches(
    rank: int, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's minibatches, drawn on the CPU (the same values on every device), moved to
    ``device``."""
    g = torch.Generator().manual_seed(100 + rank)
    sizes = (8, 13) if rank == 0 else (11, 6)
    batches = [
        (torch.randn(n, 5, generator=g) * (1 + rank), torch.randint(0, 3, (n,), generator=g))
        for n in sizes
    ]
    return [(x.to(device), a.to(device)) for x, a in batches]


def probed_policy(device: torch.device | str = "cpu") -> tuple[TinyPolicy, ComponentContext]:
    torch.manual_seed(0)
    policy = TinyPolicy()
    with torch.no_grad():
        policy.actor_mlp.layer_1.linear.bias[0] = -30.0
    policy.to(device)
    ctx = ComponentContext()
    attach_all_probes(policy, ctx)
    return policy, ctx


def run(policy: TinyPolicy, batches) -> None:
    for x, a in batches:
        F.cross_entropy(policy(x), a).backward()


def worker(rank: int, init_file: str, out_dir: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    if torch.device(device).type == "cuda":  # as tests/conftest.py sets the test process
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        policy, ctx = probed_policy(device)
        run(policy, rank_batches(rank, device))
        slots = [e for t in ctx.model_metrics.values() for e in t.reduced_tensors().values()]
        kinds = {(str(tensor.dtype), how) for tensor, how in slots}
        calls = count_collectives()
        metrics = StatsReporter(ctx).collect()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(metrics))
        counts = {**calls, "tensors": len(slots), "kinds": len(kinds)}
        Path(out_dir, f"calls{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def count_collectives() -> dict[str, int]:
    """Count the calls of the two collectives the report makes (they still run)."""
    calls = {"all_reduce": 0, "all_gather_object": 0}
    for name in calls:
        collective = getattr(dist, name)

        def counted(*args, _collective=collective, _name=name, **kwargs):
            calls[_name] += 1
            return _collective(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def test_all_reduced_metrics_equal_union_of_ranks(tmp_path: Path, device: torch.device) -> None:
    # both ranks on the one device (gloo reduces device tensors through the host)
    init_file = str(tmp_path / "init")
    mp.spawn(worker, args=(init_file, str(tmp_path), str(device)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0 == r1  # every rank reports the global figures
    # one exchange of layouts, then one all_reduce per dtype and way of combining (sums,
    # counts, gradient_flow's means), however many accumulators there are
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"calls{rank}.json").read_text())
        assert calls["all_gather_object"] == 1
        assert calls["all_reduce"] == calls["kinds"] <= 4 < calls["tensors"]

    policy, ctx = probed_policy(device)  # one process over the union of both ranks' samples
    run(policy, rank_batches(0, device) + rank_batches(1, device))
    union = StatsReporter(ctx).collect()
    for key in UNION_KEYS:
        assert r0[key] == pytest.approx(union[key], rel=1e-6), key
    assert r0["probes/relu/actor_mlp/samples"] == 38

    # gradient_flow is an EMA per rank: the global value is the mean of the ranks' EMAs
    per_rank = []
    for rank in (0, 1):
        policy, ctx = probed_policy(device)
        run(policy, rank_batches(rank, device))
        per_rank.append(StatsReporter(ctx).collect()["probes/gradient_flow/actor_mlp/rms"])
    expected = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    assert r0["probes/gradient_flow/actor_mlp/rms"] == pytest.approx(expected, rel=1e-6)
