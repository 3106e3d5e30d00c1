"""Benchmark 4: the empty path (target: <= 1.01x).

A: the bare loop (case ``bare``): ``PPOTrainer.train()`` called directly with an empty
callback list and a fresh ``ComponentContext``; no TrainTool, no sinks (the trainer's
session has an empty sink group and no lifecycle hook), no run directory.
B: the same training through ``TrainTool.invoke()`` with all of that machinery present
and nothing attached (no probes, no lifecycle hooks, every sink off, no evaluation or
checkpoints): what a user pays for the toolkit before switching anything on.

Both sides use the same ``ActorCriticPolicy`` (a ``PolicyAutoBuilder``), so its
``hooks_idle()`` check (once per rollout and per minibatch) is in both.

Because a 1 % difference is far below the run-to-run noise of a shared machine, the
script also measures the machinery directly: a run of B with every trainer-callback
dispatch and session call timed (``time_callbacks``), reported as the share of the run's
wall time spent in them (the session's epoch points, StatsReporter, the sinks, the
lifecycle manager's points, the callbacks).

    python -m benchmarks.empty_path [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import statistics

from benchmarks.ab import (
    Comparison,
    Side,
    interleave,
    parse_args,
    print_table,
    run_case,
    write_results,
)


def comparisons(quick: bool) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480}
    return [
        Comparison(
            "machinery, nothing attached",
            Side("bare loop", "bare", dict(base)),
            Side("TrainTool, empty", "ours", dict(base, track_memory=False)),
            target="<= 1.01",
        )
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 9, "empty_path.json", argv)
    comps = comparisons(args.quick)
    interleave(comps, args.repeats)
    print_table("empty path (wall time TrainTool / bare loop)", comps)
    shares = []
    for _ in range(args.repeats):
        r = run_case("ours", dict(comps[0].b.params, time_callbacks=True))
        shares.append(r["callback_seconds"] / r["seconds"])
    share = statistics.median(shares)
    print(f"share of wall time in trainer callbacks (TrainTool, empty): {share:.4f}")
    write_results(
        args.out,
        "empty path: t(TrainTool, nothing attached)/t(bare)",
        comps,
        callback_share=share,
        callback_shares=shares,
    )


if __name__ == "__main__":
    main()
