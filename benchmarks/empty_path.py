"""Benchmark 4: the empty path (target: <= 1.01x).

A: the bare loop (case ``bare``); B: the same training through ``TrainTool.invoke()``
with nothing attached: what a user pays for the toolkit before switching anything on.
A 1 % difference is below a shared machine's noise, so the script also times every
trainer-callback dispatch and session call in runs of B (``time_callbacks``) and reports
their share of the run's wall time.

    python -m benchmarks.empty_path [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import statistics

from benchmarks import ab


def comparisons(quick: bool) -> list[ab.Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480}
    return [
        ab.Comparison(
            "machinery, nothing attached",
            ab.Side("bare loop", "bare", dict(base)),
            ab.Side("TrainTool, empty", "ours", dict(base, track_memory=False)),
            target="<= 1.01",
        )
    ]


def main(argv: list[str] | None = None) -> None:
    args = ab.parse_args(__doc__.splitlines()[0], 9, "empty_path.json", argv)
    comps = comparisons(args.quick)
    ab.interleave(comps, args.repeats)
    ab.print_table("empty path (wall time TrainTool / bare loop)", comps)
    shares = []
    for _ in range(args.repeats):
        r = ab.run_case("ours", dict(comps[0].b.params, time_callbacks=True))
        shares.append(r["callback_seconds"] / r["seconds"])
    share = statistics.median(shares)
    print(f"share of wall time in trainer callbacks (TrainTool, empty): {share:.4f}")
    ab.write_results(
        args.out,
        "empty path: t(TrainTool, nothing attached)/t(bare)",
        comps,
        callback_share=share,
        callback_shares=shares,
    )


if __name__ == "__main__":
    main()
