"""Benchmark 1: trainer throughput against Stable-Baselines3 PPO (target: >= 3x SB3).

Both sides train CartPole-v1 with identical hyperparameters (4 envs, 128 steps, 4
minibatches of 128, 4 update epochs, 64-64 tanh actor and critic, CPU, one torch
thread), no probes. Ours runs twice: with gymnasium's sync vector env (what SB3's
DummyVecEnv does, the headline) and with CartPole's own batched ``vector_entry_point``.

    python -m benchmarks.throughput [--quick] [--repeats N] [--out PATH]

The reported figure is SPS(ours) / SPS(SB3) = median over pairs of t(SB3) / t(ours).
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, measure_and_record, parse_args


def comparisons(quick: bool) -> list[Comparison]:
    steps = 512 if quick else 40_960
    common = {"total_timesteps": steps, "track_memory": False}
    sb3 = Side("sb3", "sb3", dict(common))
    return [
        Comparison(
            "sync (headline)",
            Side("ours-sync", "ours", dict(common, vectorization="sync")),
            sb3,
            target=">= 3.0",
        ),
        Comparison(
            "vector_entry_point",
            Side("ours-vector", "ours", dict(common, vectorization="vector_entry_point")),
            sb3,
            target=">= 3.0",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 5, "throughput.json", argv)
    measure_and_record(
        args,
        comparisons(args.quick),
        "throughput",
        table_title="trainer throughput: speed-up over SB3",
        results_title="throughput: t(sb3)/t(ours) = speed-up of ours",
        ratios="speedup_over_sb3",
        ratio_label="SB3 time / ours",
    )


if __name__ == "__main__":
    main()
