"""The all-reduce of probe state at a report, across two gloo processes on this machine.

The cartpole recipe's policy (64x64 actor and critic) with the recipe's four probes on
both MLPs, per layer (``recipes.cartpole.add_probes``). Each report, every rank feeds its
probes four minibatches of 64 rows, then combines the trackers in one of two ways,
alternating report by report in the same processes:

- ``per_tensor``: one ``all_gather_object`` of each tracker's layout and one
  ``all_reduce`` per accumulator tensor (how e48ca4f reduced, one round trip each);
- ``one_buffer``: :func:`policy_probes.probes.state.all_reduce_trackers`, what
  ``StatsReporter`` does now: one layout exchange, then one ``all_reduce`` of one flat
  buffer per dtype and way of combining.

Prints and writes the median milliseconds per report and the collective calls of each
(tests/test_probe_all_reduce.py checks that the one-buffer route gives the union's values).

    python -m benchmarks.all_reduce_cost [--reports N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from policy_probes import ComponentContext
from policy_probes.probes.state import BY_MAX, BY_MEAN, all_reduce_trackers
from trainers.config import PolicyConfig
from trainers.policy import ActorCriticPolicy

OUT = Path(__file__).parent / "results" / "all_reduce_cost.json"


class _Attach:
    """What ``recipes.cartpole.add_probes`` calls, onto a bare policy and context."""

    def __init__(self, policy: ActorCriticPolicy, context: ComponentContext) -> None:
        self.policy, self.context = policy, context

    def add_training_hook(self, pattern: str, builder: Any, **placement: Any) -> None:
        self.policy.attach(pattern, builder, self.context, **placement)

    def add_training_backward_hook(self, pattern: str, builder: Any, **placement: Any) -> None:
        self.policy.attach(pattern, builder, self.context, backward=True, **placement)


def per_tensor(trackers: dict[str, Any]) -> None:
    """How e48ca4f reduced: one layout exchange per tracker, one all_reduce per accumulator."""
    world = dist.get_world_size()
    for tracker in trackers.values():
        slots = tracker.reduced_tensors()
        layout = sorted((k, tuple(t.shape), str(t.dtype), how) for k, (t, how) in slots.items())
        layouts: list[Any] = [None] * world
        dist.all_gather_object(layouts, layout)
        for key, shape, dtype_name, how in sorted({e for lay in layouts for e in lay}):
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            t = slots[key][0] if key in slots else torch.zeros(shape, dtype=dtype)
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX if how == BY_MAX else dist.ReduceOp.SUM)
            tracker.set_reduced(key, t / world if how == BY_MEAN else t)


def count_collectives() -> dict[str, int]:
    """Count this process's ``all_reduce`` and ``all_gather_object`` calls from now on
    (``torch.distributed``'s functions wrapped; the counts are the returned dict's)."""
    calls = {"all_reduce": 0, "all_gather_object": 0}
    for name in calls:
        collective = getattr(dist, name)

        def counted(*args: Any, _c: Any = collective, _n: str = name, **kw: Any) -> Any:
            calls[_n] += 1
            return _c(*args, **kw)

        setattr(dist, name, counted)
    return calls


def _feed(policy: ActorCriticPolicy, rank: int, report: int) -> None:
    g = torch.Generator().manual_seed(1000 * report + rank)
    for _ in range(4):
        obs = torch.randn(64, 4, generator=g)
        actions = torch.randint(0, 2, (64,), generator=g)
        logits = policy.actor_head(policy.actor_mlp(obs))
        value = policy.critic_head(policy.critic_mlp(obs)).squeeze(-1)
        (F.cross_entropy(logits, actions) + value.pow(2).mean()).backward()


def _worker(rank: int, init_file: str, reports: int, out: str) -> None:
    import recipes.cartpole as recipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        space = gym.spaces.Box(-1.0, 1.0, (4,))
        cfg = PolicyConfig(hidden_sizes=[64, 64], activation="relu")  # the recipe's
        policy = ActorCriticPolicy(space, gym.spaces.Discrete(2), cfg)
        context = ComponentContext()
        recipe.add_probes(_Attach(policy, context), ("actor_mlp", "critic_mlp"))
        trackers = dict(context.model_metrics)
        calls = count_collectives()
        times: dict[str, list[float]] = {"per_tensor": [], "one_buffer": []}
        counts: dict[str, dict[str, int]] = {}
        for report in range(2 * reports):
            way = "per_tensor" if report % 2 == 0 else "one_buffer"
            _feed(policy, rank, report)
            accumulators = sum(len(t.reduced_tensors()) for t in trackers.values())
            dist.barrier()
            before = dict(calls)
            start = time.perf_counter()
            (per_tensor if way == "per_tensor" else all_reduce_trackers)(trackers)
            times[way].append(time.perf_counter() - start)
            counts[way] = {k: calls[k] - before[k] for k in calls}
            for tracker in trackers.values():
                tracker.reset()
        if rank == 0:
            result = {
                "trackers": len(trackers),
                "reports": reports,
                "median_ms": {w: 1000 * statistics.median(v) for w, v in times.items()},
                "collectives_per_report": counts,
                "accumulators": accumulators,
            }
            Path(out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=int, default=50, help="reports of each way")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(os.path.join(tmp, "init"), args.reports, result_file),
            nprocs=2,
            join=True,
        )
        result = json.loads(Path(result_file).read_text())
    write_result(args.out, result)
    return 0


def write_result(out: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``out`` as indented JSON and print it (both all-reduce scripts)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
