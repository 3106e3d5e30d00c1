"""Steps per second of the Atari recipe without probes, whole process, on the gymnasium
route and on EnvPool (issue 41): interleaved pairs of ``policy-probes run`` subprocesses,
each timed from start to exit (imports, env construction, training, teardown).

    python -m benchmarks.envpool_sps [--pairs 3] [--steps 8192] [--out PATH]

Each pair runs both backends in turn (the order alternates from pair to pair); the figure
is the median over pairs of t(gymnasium) / t(envpool), so a load that drifts slowly
weighs on both sides of a pair alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainers import TrainTool

BACKENDS = ("gymnasium", "envpool")


def recipe_without_probes() -> TrainTool:
    """``recipes.atari.train`` with its probes removed (the A/B baseline of the benchmarks)."""
    from recipes.atari import train

    tool = train().model_copy(deep=True)
    object.__setattr__(tool, "__pydantic_private__", {**tool.__pydantic_private__, "_builders": []})
    return tool


def run_once(backend: str, steps: int, run_dir: Path) -> dict[str, float]:
    """Seconds of one whole ``policy-probes run`` of the recipe without probes, and the
    medians over its epochs of the rollout's SPS and the update's seconds (the run's
    records): where the time went."""
    cmd = [
        sys.executable,
        "-m",
        "policy_probes.cli",
        "run",
        "benchmarks.envpool_sps.recipe_without_probes",
        f"trainer.total_timesteps={steps}",
        f"env.backend={backend}",
        "evaluation.at_end=false",
        "checkpoint.at_end=false",
        "sinks.wandb=false",
        "sinks.console=false",
        f"run_dir={run_dir}",
        "--no-progress",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("hook_point") == "POST_EPOCH"]
    return {
        "seconds": seconds,
        "rollout_sps": statistics.median(r["perf/rollout_sps"] for r in epochs),
        "update_seconds": statistics.median(r["perf/update_seconds"] for r in epochs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/envpool_sps.json"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = BACKENDS if pair % 2 == 0 else BACKENDS[::-1]
            runs = {b: run_once(b, args.steps, Path(tmp) / f"{b}-{pair}") for b in order}
            row = {"pair": pair, "first": order[0]}
            for b in BACKENDS:
                row.update({f"{b}_{k}": v for k, v in runs[b].items()})
                row[f"{b}_sps"] = args.steps / runs[b]["seconds"]
            row["ratio"] = runs["gymnasium"]["seconds"] / runs["envpool"]["seconds"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {
        "steps": args.steps,
        "pairs": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "median_sps": {b: statistics.median(r[f"{b}_sps"] for r in rows) for b in BACKENDS},
        "median_rollout_sps": {
            b: statistics.median(r[f"{b}_rollout_sps"] for r in rows) for b in BACKENDS
        },
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "pairs"}))


if __name__ == "__main__":
    main()
