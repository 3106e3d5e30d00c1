"""The trainability probe's cost: the cartpole recipe as it ships (its four probes, the
toolkit's default sampling, 200k steps: 390 epochs) against the same run with
``trainability`` on ``actor_mlp`` and ``critic_mlp`` at its default schedule, whole
processes interleaved A B A B ..., the median of the paired wall-time ratios.

    python -m benchmarks.trainability_cost [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, adding, measure_and_record, parse_args

#: the probe at its defaults on the recipe's two probed components
SPECS = ["trainability@actor_mlp", "trainability@critic_mlp"]


def comparisons(quick: bool) -> list[Comparison]:
    shipped = Side(
        "recipe as shipped",
        "recipe",
        {
            "total_timesteps": 4096 if quick else 200_000,
            "probes": True,
            "probe_budget": 0.05,  # the toolkit's default (the cases' own is every pass)
        },
    )
    return [
        adding("trainability (default schedule)", shipped, "+ trainability", extra_probes=SPECS)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", 6, "trainability_cost.json", argv)
    measure_and_record(args, comparisons(args.quick), "trainability probe on the cartpole recipe")


if __name__ == "__main__":
    main()
