"""The remedies that work for PPO, on permuted CartPole, and a forked-arms test of
plasticity loss (issue 25; docs/plasticity.md).

Part 1, whole runs: ``recipes.cartpole_permuted.train`` (as in
:mod:`benchmarks.plasticity`) once per arm of :data:`ARMS` and seed. ``continual_backprop``
uses a maturity of 100 steps (``lop/algos/cbp.py``'s default: Dohare et al.'s PPO maturity
of 10000 steps exceeds these runs' 7680); ``adam_betas`` is Dohare et al.'s PPO setting;
the ``none`` runs keep checkpoints every quarter, the parents of part 2.

Part 2, forked arms: every seed's ``none`` run is forked at the middle and at three
quarters with ``policy-probes arms`` (:mod:`policy_probes.analysis.arms`) into
:data:`FORK_ARMS` (LayerNorm cannot be switched on in a fork: the checkpoint would not fit
the policy). An arm *recovers the return* when its return after the fork exceeds the
``none`` child's in the mean over seeds and for at least 4 of the 5 seeds; it *lowers* it
when the same holds with the signs reversed; otherwise the difference is unclear. The
settings and this criterion were fixed before the runs.

Every run is a ``policy-probes run`` / ``fork`` subprocess (one thread each); a run or
child already complete is reused, so an interrupted call continues where it stopped.

    nice python -m benchmarks.plasticity_ppo --seeds 1,2,3,4,5        # make plasticity-ppo
    python -m benchmarks.plasticity_ppo --from-results    # redraw figure and tables only
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.plasticity import (
    COMPONENTS,
    NO_CHECKPOINTS,
    base_overrides,
    command,
    curves,
    load_results,
    markdown,
    parser,
    publish,
    write_doc,
)

RECIPE = "recipes.cartpole_permuted.train"


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
    """:func:`~benchmarks.plasticity.base_overrides`, checkpoints (every quarter for the
    ``none`` runs, the parents of the forks; none otherwise) and the arm's overrides."""
    quarters = [f"checkpoint.every_epochs={epochs // 4}", "checkpoint.keep_last=10"]
    checkpoints = quarters if arm == "none" else NO_CHECKPOINTS
    return base_overrides(seed, epochs, period, run_dir) + checkpoints + ARMS[arm]


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
    """Per forked arm: the return after the fork and over its last quarter, the difference
    to the ``none`` child, the dormant fractions and the :func:`verdict`."""
    rows = []
    comp = result["comparison"]
    for arm in FORK_ARMS:
        r, last = comp[arm]["return"], comp[arm]["return_last"]
        diffs = list(r["diff_per_parent"].values())
        dormant = [
            f"{comp[arm].get(f'probes/relu/{c}/dormant_fraction', {}).get('mean', math.nan):.3f}"
            for c in COMPONENTS
        ]
        rows.append(
            [
                arm,
                f"{r['mean']:.0f} ± {r['std']:.0f}",
                f"{r['diff_mean']:+.0f} ± {r['diff_std']:.0f}",
                f"{sum(d > 0 for d in diffs)} of {len(diffs)}",
                f"{last['mean']:.0f} ± {last['std']:.0f}",
                f"{last['diff_mean']:+.0f} ± {last['diff_std']:.0f}",
                *dormant,
                "-" if arm == "none" else verdict(diffs),
            ]
        )
    head = ["arm", "return after the fork", "Δ vs none", "seeds with Δ > 0"]
    head += ["return, last quarter", "Δ vs none", "dormant actor", "dormant critic", "verdict"]
    return markdown(head, rows)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__, "plasticity_ppo").parse_args(argv)
    if args.from_results:
        data = load_results(Path(args.results))
    else:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        runs = [run_one(a, s, args.epochs, args.period, out) for a in ARMS for s in seeds]
        wall_runs = time.perf_counter() - t0
        parents = [out / f"none-seed{s}" for s in seeds]
        epochs = (args.epochs // 2, 3 * args.epochs // 4)
        data = {
            "command": command("benchmarks.plasticity_ppo", argv),
            "arms": ARMS,
            "fork_arms": FORK_ARMS,
            "seeds": seeds,
            "epochs": args.epochs,
            "period": args.period,
            "jobs": 1,
            "wall_seconds": wall_runs,
            "runs": runs,
            "forks": {str(e): fork_test(parents, e, out) for e in epochs},
        }
    how = (
        f"whole runs and forks; {len(data['runs'])} runs in {data['wall_seconds'] / 60:.1f} "
        "min wall, one at a time, on a shared 2-core machine"
    )
    _, md, block = publish(data, args, "plasticity_ppo", how, COMPONENTS[:1])
    write_doc(Path(args.doc), block, BEGIN, END)
    fork_blocks = [
        f"Forked at epoch {epoch} of {result['end']} ({len(result['parents'])} `none` "
        f"runs; {result['wall_seconds'] / 60:.1f} min wall); means over epochs "
        f"{int(epoch) + 1}-{result['end']}, last quarter: the last "
        f"{math.ceil((result['end'] - int(epoch)) / 4)} epochs; Δ: the arm minus the "
        f"`none` child of the same seed, mean ± std over seeds; dormant: mean over "
        f"the epochs after the fork.\n\n{fork_table(result)}"
        for epoch, result in data["forks"].items()
    ]
    write_doc(Path(args.doc), "\n\n".join(fork_blocks), FORK_BEGIN, FORK_END)
    print(md)
    print("\n\n".join(fork_blocks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
