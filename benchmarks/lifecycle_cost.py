"""Benchmark 5: cost of the lifecycle interventions ``hessian``, ``policy_fisher`` and
``counterfactual``.

Per hook, against the same run without lifecycle hooks (the throughput benchmark's
CartPole setup, 50 epochs): the hook at its default schedule (the amortised overhead),
and the hook firing in every epoch (``hessian`` with ``snapshot_every=1``), whose cost per
firing is reported in *update-phase equivalents*: (t_B - t_A) / firings / (median
update-phase seconds of run A). Firings are the epochs in which the hook reported metrics.

    python -m benchmarks.lifecycle_cost [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import statistics

from benchmarks import ab

HOOKS = ("hessian", "policy_fisher", "counterfactual")


def comparisons(quick: bool) -> list[ab.Comparison]:
    base = {"total_timesteps": 2 * 512 if quick else 50 * 512, "track_memory": False}
    plain = ab.Side("no hooks", "ours", dict(base))
    out = []
    for name in HOOKS:
        hooked = dict(base, lifecycle_hooks=[name])
        every = dict(hooked, snapshot_every=1) if name == "hessian" else dict(hooked)
        out += [
            ab.Comparison(
                f"{name} (default schedule)", plain, ab.Side(name, "ours", hooked), "amortised"
            ),
            ab.Comparison(
                f"{name} (every epoch)",
                plain,
                ab.Side(f"{name} every epoch", "ours", every),
                "per firing",
            ),
        ]
    return out


def update_phase_equivalents(comp: ab.Comparison, name: str) -> dict:
    """Cost of one firing in units of one epoch's update phase (medians over pairs)."""
    per_pair = []
    for ta, tb, ea, eb in zip(
        comp.seconds_a, comp.seconds_b, comp.extra_a, comp.extra_b, strict=True
    ):
        firings = eb["lifecycle_fired"].get(name, 0)
        update = statistics.median(ea["update_seconds"])
        if firings:
            per_pair.append((tb - ta) / firings / update)
    return {
        "firings": comp.extra_b[-1]["lifecycle_fired"].get(name, 0) if comp.extra_b else 0,
        "update_phase_equivalents": statistics.median(per_pair) if per_pair else None,
    }


def main(argv: list[str] | None = None) -> None:
    args = ab.parse_args(__doc__.splitlines()[0], 3, "lifecycle_cost.json", argv)
    comps = comparisons(args.quick)
    ab.interleave(comps, args.repeats)
    ab.print_table("lifecycle interventions (wall time with / without)", comps)
    cost = {}
    for comp in comps:
        cost[comp.name] = update_phase_equivalents(comp, comp.name.split(" ")[0])
        print(f"{comp.name}: {cost[comp.name]}")
    ab.write_results(
        args.out,
        "lifecycle interventions: t(with hook)/t(without); cost per firing",
        comps,
        cost_per_firing=cost,
    )


if __name__ == "__main__":
    main()
