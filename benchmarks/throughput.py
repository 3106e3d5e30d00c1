"""Benchmark 1: trainer throughput against Stable-Baselines3 PPO (target: >= 3x SB3).

Both sides train CartPole-v1 with identical hyperparameters and no probes; ours with
gymnasium's sync vector env (the headline) and with CartPole's ``vector_entry_point``.
The figure is SPS(ours) / SPS(SB3) = median over pairs of t(SB3) / t(ours).

    python -m benchmarks.throughput [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, measure_and_record, parse_args


def comparisons(quick: bool) -> list[Comparison]:
    common = {"total_timesteps": 512 if quick else 40_960, "track_memory": False}
    sb3 = Side("sb3", "sb3", dict(common))
    return [
        Comparison(name, Side(label, "ours", dict(common, vectorization=mode)), sb3, ">= 3.0")
        for name, label, mode in (
            ("sync (headline)", "ours-sync", "sync"),
            ("vector_entry_point", "ours-vector", "vector_entry_point"),
        )
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
