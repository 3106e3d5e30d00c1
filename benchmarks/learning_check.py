"""Learning check: do the recipes learn?

* CartPole (``recipes.cartpole.train``): mean evaluation return >= 475 within 200k env
  steps on at least 4 of 5 seeds.
* Pendulum (``recipes.pendulum.train``): mean evaluation return > -400 within 1M env
  steps on at least 3 of 5 seeds (a random policy scores about -1200).

"Within N steps" means: some evaluation (10 deterministic episodes, every 10 epochs and
after the last one) at or before N steps reached the threshold. The table also shows
the final evaluation. ``--early-stop`` ends a seed at its first passing evaluation (saves
time on the long Pendulum budget; the steps it took are reported).

    python -m benchmarks.learning_check --recipe cartpole --seeds 1,2,3,4,5 --jobs 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from benchmarks.ab import write_json

CHECKS: dict[str, dict[str, Any]] = {
    "cartpole": dict(target="recipes.cartpole.train", threshold=475.0, budget=200_000, need=4),
    "pendulum": dict(target="recipes.pendulum.train", threshold=-400.0, budget=1_000_000, need=3),
}


def run_seed(args: tuple[str, int, bool, str]) -> dict[str, Any]:
    """Train one seed of one recipe and return its evaluation history."""
    name, seed, early_stop, out_root = args
    import torch

    from policy_probes.recipe_launch import load_recipe
    from trainers import TrainerHook

    check = CHECKS[name]
    torch.set_num_threads(1)
    tool = load_recipe(check["target"])()
    tool.seed = seed
    tool.run_dir = Path(out_root) / f"{name}-seed{seed}"
    tool.trainer.total_timesteps = check["budget"]
    tool.wandb.mode = "disabled"
    tool.sinks.console = False
    tool.progress = False
    history: list[tuple[int, float]] = []

    class Watch(TrainerHook):
        def on_epoch_end(self, state):
            if state.eval_scores.get("epoch") == state.epoch:
                history.append((state.agent_step, state.eval_scores["return_mean"]))
                if early_stop and state.eval_scores["return_mean"] >= check["threshold"]:
                    state.stop_training = True

    tool.add_trainer_hook(Watch())
    t0 = time.perf_counter()
    result = tool.invoke()
    wall = time.perf_counter() - t0
    passing = [s for s, r in history if r >= check["threshold"]]
    return {
        "recipe": name,
        "seed": seed,
        "steps_run": result.agent_step,
        "best_eval": max(r for _, r in history),
        "final_eval": history[-1][1],
        "first_step_reached": passing[0] if passing else None,
        "passed": bool(passing),
        "wall_seconds": wall,
        "sps": result.agent_step / wall,
        "history": history,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", choices=[*CHECKS, "all"], default="all")
    p.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (one core each)")
    p.add_argument(
        "--early-stop", action="store_true", help="stop a seed at its first passing evaluation"
    )
    p.add_argument("--out", default="runs/learning_check", help="run dirs and results.json go here")
    args = p.parse_args(argv)
    names = list(CHECKS) if args.recipe == "all" else [args.recipe]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(n, s, args.early_stop, str(out)) for n in names for s in seeds]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(run_seed, jobs, chunksize=1)

    from rich.console import Console
    from rich.table import Table

    head = ("recipe", "seed", "steps run", "best eval", "final eval", "first step >= threshold")
    table = Table(*head, "SPS", "pass", title="learning check")
    summary = {}
    for n in names:
        rows = [r for r in results if r["recipe"] == n]
        for r in rows:
            table.add_row(
                n,
                str(r["seed"]),
                f"{r['steps_run']:,}",
                f"{r['best_eval']:.1f}",
                f"{r['final_eval']:.1f}",
                "-" if r["first_step_reached"] is None else f"{r['first_step_reached']:,}",
                f"{r['sps']:,.0f}",
                "yes" if r["passed"] else "no",
            )
        c = CHECKS[n]
        passed = sum(r["passed"] for r in rows)
        summary[n] = {**c, "seeds": len(rows), "passed": passed}
        summary[n]["ok"] = passed >= min(c["need"], len(rows))
    Console().print(table)
    for n, s in summary.items():
        print(
            f"{n}: {s['passed']}/{s['seeds']} seeds reached {s['threshold']} within {s['budget']:,} steps "
            f"(need {s['need']}/5) -> {'PASS' if s['ok'] else 'FAIL'}"
        )
    write_json(out / "results.json", {"summary": summary, "runs": results})
    print(f"results: {out / 'results.json'}")
    return 0 if all(s["ok"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
