"""Benchmark 5: cost of the lifecycle interventions ``hessian``, ``policy_fisher`` and
``counterfactual``.

For each hook two comparisons against the same run without lifecycle hooks (CartPole
setup of the throughput benchmark, 50 epochs):

* *default schedule*: the hook as a user gets it (``TrainTool(hooks=[name])``): the
  amortised overhead, wall time with / without;
* *every epoch*: the hook firing in every epoch (``hessian`` fires at SNAPSHOT, so
  ``snapshot_every=1``; the other two fire every epoch by default). Its cost per firing
  in *update-phase equivalents* is (t_B - t_A) / firings / (median update-phase seconds
  of run A): 1.0 means one firing costs as much as one epoch's whole PPO update phase.

Firings are counted from the epochs in which the hook reported metrics.

    python -m benchmarks.lifecycle_cost [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import statistics

from benchmarks.ab import Comparison, Side, interleave, parse_args, print_table, write_results

HOOKS = ("hessian", "policy_fisher", "counterfactual")


def comparisons(quick: bool) -> list[Comparison]:
    base = {"total_timesteps": 2 * 512 if quick else 50 * 512, "track_memory": False}
    plain = Side("no hooks", "ours", dict(base))
    out = []
    for name in HOOKS:
        out.append(
            Comparison(
                f"{name} (default schedule)",
                plain,
                Side(name, "ours", dict(base, lifecycle_hooks=[name])),
                target="amortised",
            )
        )
        every = dict(base, lifecycle_hooks=[name])
        if name == "hessian":
            every["snapshot_every"] = 1
        out.append(
            Comparison(
                f"{name} (every epoch)",
                plain,
                Side(f"{name} every epoch", "ours", every),
                target="per firing",
            )
        )
    return out


def update_phase_equivalents(comp: Comparison, name: str) -> dict:
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
    args = parse_args(__doc__.splitlines()[0], 3, "lifecycle_cost.json", argv)
    comps = comparisons(args.quick)
    interleave(comps, args.repeats)
    print_table("lifecycle interventions (wall time with / without)", comps)
    cost = {}
    for comp in comps:
        name = comp.name.split(" ")[0]
        cost[comp.name] = update_phase_equivalents(comp, name)
        print(f"{comp.name}: {cost[comp.name]}")
    write_results(
        args.out,
        "lifecycle interventions: t(with hook)/t(without); cost per firing",
        comps,
        cost_per_firing=cost,
    )


if __name__ == "__main__":
    main()
