"""The remedies that work for PPO, on permuted CartPole, and a forked-arms test of
plasticity loss (issue 25; docs/plasticity.md).

Part 1, whole runs: ``recipes.cartpole_permuted.train`` (as in
:mod:`benchmarks.plasticity`: 480 epochs, a new permutation of the 4 observation
features every 40, 64-64 ReLU actor and critic, constant lr 3e-3) once per arm and seed:

* ``none``: no change (checkpoints every 120 epochs: the parents of part 2);
* ``l2_init``: L2 towards the initial parameters, ``coef=0.01``, on both MLPs;
* ``soft_shrink_perturb``: ``theta <- 0.9999 theta + 1e-4 theta_init`` after every step,
  on both MLPs;
* ``soft_shrink_perturb+layer_norm``: the same with ``policy.layer_norm=true``;
* ``continual_backprop``: CBP on both MLPs, replacement rate 1e-3, maturity 100 steps
  (``lop/algos/cbp.py``'s defaults: Dohare et al.'s PPO maturity of 10000 steps exceeds
  these runs' 7680), decay 0.99;
* ``adam_betas``: Adam with ``betas=(0.99, 0.99)`` (Dohare et al.'s PPO setting).

Part 2, forked arms: every seed's ``none`` run is forked at epoch 240 (the middle) and 360
(three quarters) with ``policy-probes arms`` (:mod:`policy_probes.analysis.arms`) into ``none``,
``l2_init``, ``soft_shrink_perturb``, ``continual_backprop`` (settings as above) and
``plasticity_injection`` (both MLPs, injected at the end of the first epoch after the
fork). LayerNorm cannot be switched on in a fork (the checkpoint would not fit the
policy); Adam's betas could, but they are not a remedy and were left out to save time. An arm *recovers the return* when its return after the fork exceeds the
``none`` child's in the mean over seeds and for at least 4 of the 5 seeds; it *lowers* it
when the same holds with the signs reversed; otherwise the difference is unclear. The
settings and this criterion were fixed before the runs.

Every run is a ``policy-probes run`` / ``fork`` subprocess (one thread each); a run or
child already complete is reused, so an interrupted call continues where it stopped.

    nice python -m benchmarks.plasticity_ppo --seeds 1,2,3,4,5        # make plasticity-ppo
    python -m benchmarks.plasticity_ppo --from-results    # redraw figure and tables only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.plasticity import (
    COMPONENTS,
    curves,
    figure,
    load_results,
    period_table,
    plain,
    summarize,
    table,
)

RECIPE = "recipes.cartpole_permuted.train"
BATCH = 4 * 128  # agent steps per epoch (the recipe's 4 envs x 128 steps)


def remedies(*specs: str) -> str:
    return f"remedies={json.dumps([s.format(c=c) for s in specs for c in COMPONENTS])}"


L2 = remedies("l2_init@{c}:coef=0.01")
SOFT = remedies("soft_shrink_perturb@{c}:shrink=0.9999,noise=0.0001")
CBP = remedies("continual_backprop@{c}:replacement_rate=0.001,maturity_threshold=100,decay=0.99")
BETAS = "trainer.adam_betas=[0.99,0.99]"
INJECT = remedies("plasticity_injection@{c}:every_epochs=1")
#: whole-run arms: overrides
ARMS: dict[str, list[str]] = {
    "none": [],
    "l2_init": [L2],
    "soft_shrink_perturb": [SOFT],
    "soft_shrink_perturb+layer_norm": [SOFT, "policy.layer_norm=true"],
    "continual_backprop": [CBP],
    "adam_betas": [BETAS],
}
#: forked arms: ``policy-probes arms --arm`` values
FORK_ARMS: dict[str, str] = {
    "none": "none",
    "l2_init": f"l2_init:{L2}",
    "soft_shrink_perturb": f"soft_shrink_perturb:{SOFT}",
    "continual_backprop": f"continual_backprop:{CBP}",
    "plasticity_injection": f"plasticity_injection:{INJECT}",
}
BEGIN, END = "<!-- plasticity-ppo:begin -->", "<!-- plasticity-ppo:end -->"
FORK_BEGIN, FORK_END = "<!-- plasticity-forks:begin -->", "<!-- plasticity-forks:end -->"


def run_overrides(arm: str, seed: int, epochs: int, period: int, run_dir: Path) -> list[str]:
    out = [
        f"seed={seed}",
        f"run_dir={run_dir}",
        f"trainer.total_timesteps={epochs * BATCH}",
        f"env.permute_obs_every={period * BATCH}",
        "sinks.console=false",
        "sinks.csv=false",
        "sinks.tensorboard=false",
        "wandb.mode=disabled",
    ]
    if arm == "none":  # the parents of the forks: checkpoints at every quarter
        out += [f"checkpoint.every_epochs={epochs // 4}", "checkpoint.keep_last=10"]
    else:
        out += ["checkpoint.every_epochs=0", "checkpoint.at_end=false"]
    return out + ARMS[arm]


def finished(run_dir: Path, epochs: int) -> bool:
    from policy_probes.analysis.arms import last_epoch

    return (run_dir / "metrics.jsonl").is_file() and last_epoch(run_dir) >= epochs


def run_one(arm: str, seed: int, epochs: int, period: int, out: Path) -> dict[str, Any]:
    run_dir = out / f"{arm}-seed{seed}"
    t0 = time.perf_counter()
    if not finished(run_dir, epochs):
        cmd = [sys.executable, "-m", "policy_probes.cli", "run", RECIPE]
        cmd += [*run_overrides(arm, seed, epochs, period, run_dir), "--no-progress", "--overwrite"]
        with open(out / f"{arm}-seed{seed}.log", "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(f"{arm} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return {
        "arm": arm,
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_seconds": time.perf_counter() - t0,
        **curves(run_dir, epochs),
    }


def fork_test(parents: list[Path], epoch: int, out: Path) -> dict[str, Any]:
    from policy_probes.analysis.arms import parse_arm, run_arms

    arms = [parse_arm(text) for text in FORK_ARMS.values()]
    t0 = time.perf_counter()
    result, children = run_arms(parents, epoch, arms, out / f"forks-e{epoch}", jobs=1)
    failed = [f"{c.arm.name}/{c.parent}: {c.errors}" for c in children if c.errors]
    if failed:
        raise RuntimeError(f"forked children failed: {failed}")
    result["wall_seconds"] = time.perf_counter() - t0
    print(f"forks at {epoch}: {result['wall_seconds']:.0f} s", flush=True)
    return result


def verdict(diffs: list[float]) -> str:
    """The criterion fixed before the runs (module docstring)."""
    n, up, down = len(diffs), sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    mean = sum(diffs) / n
    if mean > 0 and up >= n - 1:
        return "recovers"
    if mean < 0 and down >= n - 1:
        return "lowers"
    return "unclear"


def fork_table(result: dict[str, Any]) -> str:
    rows = [
        "| arm | return after the fork | Δ vs none | seeds with Δ > 0 | return, last quarter "
        "| Δ vs none | dormant actor | dormant critic | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    comp = result["comparison"]
    for arm in FORK_ARMS:
        r, last = comp[arm]["return"], comp[arm]["return_last"]
        diffs = list(r["diff_per_parent"].values())
        dormant = [
            comp[arm].get(f"probes/relu/{c}/dormant_fraction", {}).get("mean", math.nan)
            for c in COMPONENTS
        ]
        rows.append(
            f"| {arm} | {r['mean']:.0f} ± {r['std']:.0f} | {r['diff_mean']:+.0f} ± "
            f"{r['diff_std']:.0f} | {sum(d > 0 for d in diffs)} of {len(diffs)} | "
            f"{last['mean']:.0f} ± {last['std']:.0f} | {last['diff_mean']:+.0f} ± "
            f"{last['diff_std']:.0f} | {dormant[0]:.3f} | {dormant[1]:.3f} | "
            f"{'-' if arm == 'none' else verdict(diffs)} |"
        )
    return "\n".join(rows)


def write_block(path: Path, begin: str, end: str, block: str) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--epochs", type=int, default=480)
    p.add_argument("--period", type=int, default=40)
    p.add_argument("--out", default="runs/plasticity_ppo")
    p.add_argument("--results", default="benchmarks/results/plasticity_ppo.json")
    p.add_argument("--figure", default="docs/figures/plasticity_ppo.png")
    p.add_argument("--doc", default="docs/plasticity.md")
    p.add_argument("--from-results", action="store_true")
    args = p.parse_args(argv)
    results = Path(args.results)
    if args.from_results:
        data = load_results(results)
    else:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        runs = [run_one(a, s, args.epochs, args.period, out) for a in ARMS for s in seeds]
        wall_runs = time.perf_counter() - t0
        parents = [out / f"none-seed{s}" for s in seeds]
        forks = {
            str(e): fork_test(parents, e, out) for e in (args.epochs // 2, 3 * args.epochs // 4)
        }
        given = sys.argv[1:] if argv is None else argv
        data = {
            "command": "python -m benchmarks.plasticity_ppo " + shlex.join(given),
            "arms": ARMS,
            "fork_arms": FORK_ARMS,
            "seeds": seeds,
            "epochs": args.epochs,
            "period": args.period,
            "jobs": 1,
            "wall_seconds": wall_runs,
            "runs": runs,
            "forks": forks,
        }
    runs, arms, seeds, period = data["runs"], list(data["arms"]), data["seeds"], data["period"]
    summary = summarize(runs, period)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                **data,
                "summary": {k: plain(v) for k, v in summary.items()},
                "runs": [plain(r) for r in runs],
            }
        )
        + "\n"
    )
    figure(runs, arms, period, Path(args.figure))
    md = table(summary, arms, seeds)
    rel = os.path.relpath(args.figure, Path(args.doc).parent)
    block = (
        f"Reproduce: `nice {data['command']}` (whole runs and forks; {len(runs)} runs in "
        f"{data['wall_seconds'] / 60:.1f} min wall, one at a time, on a shared 2-core "
        f"machine). {len(seeds)} seeds ({', '.join(map(str, seeds))}), {data['epochs']} "
        f"epochs of 512 agent steps, a new permutation every {period} epochs; mean ± std "
        f"over seeds.\n\n{md}\n\n![plasticity_ppo]({rel})\n\n"
        f"Training episode return per period (mean over seeds):\n\n"
        f"{period_table(runs, arms, 'return', period, '{:.0f}')}\n\n"
        f"Dormant fraction of actor_mlp per period (mean over seeds):\n\n"
        f"{period_table(runs, arms, 'actor_mlp', period, '{:.2f}')}"
    )
    write_block(Path(args.doc), BEGIN, END, block)
    fork_blocks = []
    for epoch, result in data["forks"].items():
        fork_blocks.append(
            f"Forked at epoch {epoch} of {result['end']} ({len(result['parents'])} `none` "
            f"runs; {result['wall_seconds'] / 60:.1f} min wall); means over epochs "
            f"{int(epoch) + 1}-{result['end']}, last quarter: the last "
            f"{math.ceil((result['end'] - int(epoch)) / 4)} epochs; Δ: the arm minus the "
            f"`none` child of the same seed, mean ± std over seeds; dormant: mean over "
            f"the epochs after the fork.\n\n{fork_table(result)}"
        )
    write_block(Path(args.doc), FORK_BEGIN, FORK_END, "\n\n".join(fork_blocks))
    print(md)
    print("\n\n".join(fork_blocks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
