"""RLlib overhead: RLlib PPO on CartPole with the default probes against RLlib alone.

Each side is a whole process (Ray's start, the Algorithm's build, ``--iterations``
training iterations, ``algo.stop()``), run interleaved A B B A ..., for one Learner in
the driver (``num_learners=0``), one remote Learner (``1``) and two (``2``). Side B is
``probe_config`` with ``relu``, ``fisher`` and ``gradient_flow`` on ``actor_mlp`` and
``critic_mlp`` and the default ``probe_budget``; it also reports what the run measured of
itself: the Learners' ``probes/overhead_fraction`` per record (hooks, drains, the report and
its all-reduce, over the Learner's time between reports) and the driver's seconds in
:class:`ProbeRLlibCallback` (collecting the Learners' metrics, writing the record).
Results are written after every round. Run it with the RLlib venv's interpreter
(``.venv-rllib/bin/python``):

    .venv-rllib/bin/python -m benchmarks.rllib_overhead [--quick] [--repeats N] [--out PATH]

Whole processes on a shared machine scatter by more than the probes cost, so
``--alternate [ITERATIONS]`` measures the training loop alone more closely: per Learner
count one process builds a plain and a probed Algorithm side by side (the same settings
and seed; they share the process's global generators, so their episodes differ) and
alternates their training iterations (plain, probed, probed, plain, ...); the figures are
the median of the per-iteration ratios and the ratio of the totals
(``benchmarks/results/rllib_overhead_alternating.json``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ab import (
    RESULTS,
    Comparison,
    Side,
    interleave,
    json_result,
    machine,
    parse_args,
    print_table,
    summary,
    write_results,
)

PROBES = [
    f"{p}@{c}" for c in ("actor_mlp", "critic_mlp") for p in ("relu", "fisher", "gradient_flow")
]


def run_side(side: Side) -> dict[str, Any]:
    """One whole process of :func:`case` with ``side.params``: its wall time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "benchmarks.rllib_overhead", "--case", json.dumps(side.params)]
    start = time.perf_counter()
    result = json_result(cmd, env, f"rllib case {side.params}", timeout=1800)
    return {"seconds": time.perf_counter() - start, **result}


def ppo_config(num_learners: int, run_dir: str | None = None) -> Any:
    """The benchmarks' RLlib PPO on CartPole (ReLU MLP 64x64, separate actor and critic,
    1,000 steps per Learner per iteration, minibatch 128, 4 epochs), probed with
    :data:`PROBES` and the default budget when ``run_dir`` is given."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0)
        .learners(num_learners=num_learners)
        .training(train_batch_size_per_learner=1000, minibatch_size=128, num_epochs=4)
        .rl_module(
            model_config=DefaultModelConfig(
                fcnet_hiddens=[64, 64], fcnet_activation="relu", vf_share_layers=False
            )
        )
        .debugging(seed=1)
    )
    if run_dir is None:
        return config
    from policy_probes import ProbeSettings
    from policy_probes.integrations.rllib import probe_config
    from policy_probes.sinks import SinksConfig, WandbConfig

    probing = ProbeSettings(sinks=SinksConfig(console=False), wandb=WandbConfig(mode="disabled"))
    return probe_config(config, run_dir=run_dir, probes=PROBES, probing=probing)


def case(params: dict[str, Any]) -> dict[str, Any]:
    """Train RLlib PPO (probed or not) and report the training loop's own seconds."""
    import ray

    ray.init(num_cpus=max(2, params["num_learners"] + 1), include_dashboard=False)
    run_dir, driver = None, [0.0]
    if params["probes"]:
        from policy_probes.integrations.rllib import ProbeRLlibCallback

        run_dir = tempfile.mkdtemp(prefix="pp-bench-rllib-")
        on_train_result = ProbeRLlibCallback.on_train_result

        def timed(self: Any, **kwargs: Any) -> None:  # the driver's share, measured
            start = time.perf_counter()
            try:
                on_train_result(self, **kwargs)
            finally:
                driver[0] += time.perf_counter() - start

        ProbeRLlibCallback.on_train_result = timed  # type: ignore[method-assign]
    algo = ppo_config(params["num_learners"], run_dir).build_algo()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(params["iterations"]):
        algo.train()
    train_seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu  # the driver's (with 0 Learners: the Learner's too)
    algo.stop()
    ray.shutdown()
    out = {"train_seconds": train_seconds, "cpu_seconds": cpu_seconds}
    if run_dir is not None:
        out.update(own_measures(Path(run_dir) / "metrics.jsonl", params["iterations"]))
        out["driver_callback_seconds"] = driver[0]
    return out


def alternate(params: dict[str, Any]) -> dict[str, Any]:
    """A plain and a probed Algorithm in this process, their iterations alternated."""
    import ray

    learners = params["num_learners"]
    ray.init(num_cpus=max(2, 2 * learners + 1), include_dashboard=False)
    run_dir = tempfile.mkdtemp(prefix="pp-bench-rllib-alt-")
    algos = {
        "plain": ppo_config(learners).build_algo(),
        "probed": ppo_config(learners, run_dir).build_algo(),
    }
    seconds: dict[str, list[float]] = {"plain": [], "probed": []}
    for i in range(params["iterations"]):
        for side in ("plain", "probed") if i % 2 == 0 else ("probed", "plain"):
            start = time.perf_counter()
            algos[side].train()
            seconds[side].append(time.perf_counter() - start)
    for algo in algos.values():
        algo.stop()
    ray.shutdown()
    ratios = [b / a for a, b in zip(seconds["plain"], seconds["probed"], strict=True)]
    return {
        "num_learners": learners,
        "seconds": seconds,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "total_ratio": sum(seconds["probed"]) / sum(seconds["plain"]),
        **own_measures(Path(run_dir) / "metrics.jsonl", params["iterations"]),
    }


def own_measures(path: Path, iterations: int) -> dict[str, Any]:
    """What the probed run's records say of their own cost, and that every iteration has
    the headline keys (the benchmark refuses a run that lost records)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    headline = ("probes/relu/actor_mlp/dead_fraction", "probes/fisher/actor_mlp/trace")
    complete = [r for r in records if all(k in r for k in headline)]
    if len(complete) != iterations:
        raise RuntimeError(f"{len(complete)} of {iterations} records carry {headline}")
    fractions = [r["probes/overhead_fraction"] for r in records]
    return {
        "records": len(records),
        "overhead_fraction_median": statistics.median(fractions),
        "overhead_seconds_total": sum(r["probes/overhead_seconds"] for r in records),
    }


def comparisons(quick: bool, iterations: int) -> list[Comparison]:
    out = []
    for learners in (0, 1, 2):
        base = {"num_learners": learners, "iterations": 2 if quick else iterations}
        a = Side(f"rllib-{learners}", "rllib", {**base, "probes": False})
        b = Side(f"rllib-{learners} + probes", "rllib", {**base, "probes": True})
        name = f"RLlib PPO, num_learners={learners}, default probes (whole process)"
        out.append(Comparison(name, a, b, target="<= 1.05"))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:
        print(json.dumps(case(json.loads(argv[1]))))
        return
    if argv[:1] == ["--alternate-case"]:
        print(json.dumps(alternate(json.loads(argv[1]))))
        return
    if argv[:1] == ["--alternate"]:
        iterations = int(argv[1]) if len(argv) > 1 else 30
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled")
        rows = []
        for learners in (0, 1, 2):
            params = {"num_learners": learners, "iterations": iterations}
            cmd = [sys.executable, "-m", "benchmarks.rllib_overhead", "--alternate-case"]
            row = json_result([*cmd, json.dumps(params)], env, f"alternate {params}", timeout=3600)
            rows.append(row)
            print(
                f"num_learners={learners}: per-iteration probed/plain median "
                f"{row['median_ratio']:.3f}, total {row['total_ratio']:.3f}, the Learners' own "
                f"overhead fraction (median) {row['overhead_fraction_median']:.4f}"
            )
        out = RESULTS / "rllib_overhead_alternating.json"
        out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
        return
    args = parse_args(__doc__.splitlines()[0], 6, "rllib_overhead.json", argv)
    comps = comparisons(args.quick, iterations=10)

    def save() -> None:
        write_results(
            args.out,
            "rllib overhead: t(B)/t(A)",
            comps,
            overhead=summary(comps),
            train_loop={c.name: train_loop_ratio(c) for c in comps},
        )

    interleave(comps, args.repeats, run=run_side, after_round=save)
    print_table("rllib overhead (whole process, wall time with / without)", comps)
    for c in comps:
        fractions = [b["overhead_fraction_median"] for b in c.extra_b]
        print(
            f"{c.name}: training loop B/A {train_loop_ratio(c):.3f}; the Learners' own "
            f"overhead fraction (median per run) {statistics.median(fractions):.4f}"
        )


def train_loop_ratio(c: Comparison) -> float:
    """Median B/A of the training loop alone (without Ray's start and the build)."""
    return statistics.median(
        b["train_seconds"] / a["train_seconds"] for a, b in zip(c.extra_a, c.extra_b, strict=True)
    )


if __name__ == "__main__":
    main()
