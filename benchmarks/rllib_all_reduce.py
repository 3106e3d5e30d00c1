"""The all-reduce of probe state at a report under RLlib, two Learners.

RLlib 2.60 PPO on CartPole-v1 with ``num_learners=2`` (two Ray actors in the gloo group
RLlib sets up) and the RLlib overhead benchmark's probes
(:data:`benchmarks.rllib_overhead.PROBES`). In both Learners, the report's all-reduce
alternates between the two ways of :mod:`benchmarks.all_reduce_cost`, report by report in
the same processes and the same run:

- ``per_tensor``: one ``all_gather_object`` of each tracker's layout and one
  ``all_reduce`` per accumulator tensor (how e48ca4f reduced);
- ``one_buffer``: :func:`policy_probes.probes.state.all_reduce_trackers` (what
  ``StatsReporter`` does now).

Each is timed after a barrier (the wait for the slower Learner is not the collective's
cost) and its collectives are counted. Writes the median milliseconds per report of each.

    .venv-rllib/bin/python -m benchmarks.rllib_all_reduce [--iterations N] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.all_reduce_cost import write_result
from benchmarks.rllib_overhead import ppo_config

OUT = Path(__file__).parent / "results" / "rllib_all_reduce.json"


def install(learner: Any) -> None:
    """In this Learner's process: the report's all-reduce alternates the ways, timed."""
    import torch.distributed as dist

    import policy_probes.stats_reporter as reporter
    from benchmarks.all_reduce_cost import count_collectives, per_tensor

    one_buffer = reporter.all_reduce_trackers
    calls = count_collectives()
    state: dict[str, Any] = {"ms": {"per_tensor": [], "one_buffer": []}, "calls": {}}

    def alternating(trackers: dict[str, Any], group: Any = None) -> None:
        way = "per_tensor" if sum(map(len, state["ms"].values())) % 2 == 0 else "one_buffer"
        dist.barrier()
        before = dict(calls)
        start = time.perf_counter()
        (per_tensor if way == "per_tensor" else one_buffer)(trackers)
        state["ms"][way].append(1000 * (time.perf_counter() - start))
        state["calls"][way] = {k: calls[k] - before[k] for k in calls}
        state["accumulators"] = sum(len(t.reduced_tensors()) for t in trackers.values())
        state["trackers"] = len(trackers)

    reporter.all_reduce_trackers = alternating
    learner.all_reduce_bench = state


def collect(learner: Any) -> dict[str, Any]:
    """This Learner's timings, with its rank."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(), **learner.all_reduce_bench}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40, help="reports, both ways")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    import ray

    ray.init(num_cpus=3, include_dashboard=False)
    run_dir = tempfile.mkdtemp(prefix="pp-bench-rllib-allreduce-")
    algo = ppo_config(num_learners=2, run_dir=run_dir).build_algo()
    algo.learner_group.foreach_learner(install)
    for _ in range(args.iterations):
        algo.train()
    learners = [r.get() for r in algo.learner_group.foreach_learner(collect)]
    algo.stop()
    ray.shutdown()
    first = min(learners, key=lambda r: r["rank"])
    result = {
        "learners": len(learners),
        "reports": {way: len(ms) for way, ms in first["ms"].items()},
        "trackers": first["trackers"],
        "accumulators": first["accumulators"],
        "median_ms": {way: statistics.median(ms) for way, ms in first["ms"].items()},
        "median_ms_per_learner": {
            r["rank"]: {way: statistics.median(ms) for way, ms in r["ms"].items()} for r in learners
        },
        "collectives_per_report": first["calls"],
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
