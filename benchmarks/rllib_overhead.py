"""RLlib overhead: RLlib PPO on CartPole with the default probes against RLlib alone.

Each side is a whole process (Ray's start, the Algorithm's build, ``--iterations``
training iterations, ``algo.stop()``), run interleaved A B B A ..., for 1 and 2 Learners
(``num_learners=0`` and ``2``). Side B is ``probe_config`` with ``relu``, ``fisher`` and
``gradient_flow`` on ``actor_mlp`` and ``critic_mlp`` and the default ``probe_budget``.
Run it with the RLlib venv's interpreter (``.venv-rllib/bin/python``):

    .venv-rllib/bin/python -m benchmarks.rllib_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.ab import (
    Comparison,
    Side,
    interleave,
    json_result,
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


def case(params: dict[str, Any]) -> dict[str, Any]:
    """Train RLlib PPO (probed or not) and report the training loop's own seconds."""
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    ray.init(num_cpus=max(2, params["num_learners"] + 1), include_dashboard=False)
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0)
        .learners(num_learners=params["num_learners"])
        .training(train_batch_size_per_learner=1000, minibatch_size=128, num_epochs=4)
        .rl_module(
            model_config=DefaultModelConfig(
                fcnet_hiddens=[64, 64], fcnet_activation="relu", vf_share_layers=False
            )
        )
        .debugging(seed=1)
    )
    if params["probes"]:
        from policy_probes import ProbeSettings
        from policy_probes.integrations.rllib import probe_config
        from policy_probes.sinks import SinksConfig, WandbConfig

        probing = ProbeSettings(
            sinks=SinksConfig(console=False), wandb=WandbConfig(mode="disabled")
        )
        run_dir = tempfile.mkdtemp(prefix="pp-bench-rllib-")
        config = probe_config(config, run_dir=run_dir, probes=PROBES, probing=probing)
    algo = config.build_algo()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(params["iterations"]):
        algo.train()
    train_seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu  # the driver's (with 0 Learners: the Learner's too)
    algo.stop()
    ray.shutdown()
    return {"train_seconds": train_seconds, "cpu_seconds": cpu_seconds}


def comparisons(quick: bool, iterations: int) -> list[Comparison]:
    out = []
    for learners in (0, 2):
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
    args = parse_args(__doc__.splitlines()[0], 6, "rllib_overhead.json", argv)
    comps = comparisons(args.quick, iterations=10)
    interleave(comps, args.repeats, run=run_side)
    print_table("rllib overhead (whole process, wall time with / without)", comps)
    train = {  # the training loop alone (without Ray's start and the build)
        c.name: statistics.median(
            b["train_seconds"] / a["train_seconds"]
            for a, b in zip(c.extra_a, c.extra_b, strict=True)
        )
        for c in comps
    }
    write_results(
        args.out, "rllib overhead: t(B)/t(A)", comps, overhead=summary(comps), train_loop=train
    )


if __name__ == "__main__":
    main()
