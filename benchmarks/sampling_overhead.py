"""Probe overhead by design (issue 13): the five probes under the default overhead budget,
at every pass, and with a probe batch; widths 64/256/1024; SB3 + ProbeCallback.

Every comparison is probe-free (A) against probed (B) on the throughput benchmark's
CartPole setup with a ReLU policy (the relu_gradient_flow probe needs ``nn.ReLU``): all
five module probes on ``actor_mlp`` and ``critic_mlp``. B's sampling
(:mod:`policy_probes.sampling`):

* ``default``: ``probe_budget=0.05`` (the toolkit's default: every k-th pass, k set per
  epoch from the measured overhead);
* ``every``: ``probe_budget=None`` (every pass, exact; what benchmark 2 measured);
* ``probe_batch``: ``probe_schedule="probe_batch:256"`` (one dedicated forward and
  backward on 256 rollout rows per epoch, no hook in any training pass).

Keys for ``--only``: ``default``, ``every``, ``probe_batch`` (the three sides at width
64), ``widths`` (default and every
pass at 256 and 1024), ``sb3`` (SB3 PPO + ProbeCallback at the default and at every pass), ``recipe``
(``recipes.cartpole`` as it ships, 51,200 steps = 100 epochs, with and without its
probes: evaluation, JSONL/CSV sinks and checkpoints on both sides).
Same harness as every benchmark (:mod:`benchmarks.ab`): fresh interpreters, A B / B A
pairs, median of the per-pair ratios, CPU-time ratios beside them.

    python -m benchmarks.sampling_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from benchmarks.ab import (
    RESULTS,
    Comparison,
    Side,
    interleave,
    parse_args,
    print_table,
    write_results,
)

KEYS = ["default", "every", "probe_batch", "widths", "sb3", "recipe"]
DEFAULT = {"probe_budget": 0.05}
EVERY = {"probe_budget": None, "probe_schedule": "every"}
BATCH = {"probe_budget": 0.05, "probe_schedule": "probe_batch:256"}


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    steps = 512 if quick else 20_480
    out: dict[str, list[Comparison]] = {k: [] for k in KEYS}
    base = {"total_timesteps": steps, "activation": "relu"}
    plain = Side("no probes", "ours", dict(base))
    for label, sampling in (("default", DEFAULT), ("every", EVERY), ("probe_batch", BATCH)):
        out[label].append(
            Comparison(
                f"five probes x 2, {label}",
                plain,
                Side(f"probes, {label}", "ours", dict(base, probes=True, **sampling)),
                target="<= 1.05" if label == "default" else "reported",
            )
        )
    for width in (256, 1024):
        wide = {"activation": "relu", "hidden": width, "total_timesteps": 512 if quick else 8192}
        for label, sampling in (("default", DEFAULT), ("every", EVERY)):
            out["widths"].append(
                Comparison(
                    f"width {width}, {label}",
                    Side("no probes", "ours", dict(wide)),
                    Side(f"probes, {label}", "ours", dict(wide, probes=True, **sampling)),
                    target="<= 1.05" if label == "default" else "reported",
                )
            )
    sb3 = {"total_timesteps": 1024 if quick else 32_768, "activation": "relu"}
    for label, sampling in (("default", DEFAULT), ("every", EVERY)):
        out["sb3"].append(
            Comparison(
                f"SB3 + ProbeCallback, {label}",
                Side("sb3", "sb3", dict(sb3)),
                Side(
                    f"+ ProbeCallback, {label}", "sb3", dict(sb3, probe_callback=True, **sampling)
                ),
                target="<= 1.05" if label == "default" else "reported",
            )
        )
    # the cartpole recipe as it ships (evaluation, JSONL and CSV sinks, checkpoints)
    shipped = {"total_timesteps": 4096 if quick else 51_200}
    for label, sampling in (("default", DEFAULT), ("every", EVERY)):
        out["recipe"].append(
            Comparison(
                f"cartpole recipe, {label}",
                Side("recipe, no probes", "recipe", dict(shipped)),
                Side(f"recipe, {label}", "recipe", dict(shipped, probes=True, **sampling)),
                target="<= 1.05" if label == "default" else "reported",
            )
        )
    return [c for key in (only or KEYS) for c in out[key]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 3, "sampling_overhead.json", argv, KEYS)
    if args.only != KEYS and args.out == RESULTS / "sampling_overhead.json":
        args.out = RESULTS / f"sampling_overhead_{'_'.join(args.only)}.json"
    comps = comparisons(args.quick, args.only)
    interleave(comps, args.repeats)
    print_table("probe overhead with sampling (wall time with / without)", comps)
    write_results(
        args.out,
        "sampling overhead: t(B)/t(A)",
        comps,
        overhead={c.name: c.median_ratio for c in comps},
    )


if __name__ == "__main__":
    main()
