"""Benchmark 3: probe overhead across hidden widths and minibatch sizes, and tracker memory.

Target: at most 1.05x everywhere, not growing with width or batch. The probe-overhead
benchmark's setup at widths 64/256/1024 (minibatch 128), minibatches 128/512/1024/4096
(width 64; 4 envs x ``num_steps`` = 4 minibatches) and width 256 x minibatch 4096; width
1024 also with the Fisher's parameters from every 4th pass. Memory: the probe run's
``tracker_bytes_per_epoch`` for a run and a run four times longer (equal: no growth).

    python -m benchmarks.scaling [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from typing import Any

from benchmarks import ab


def setting(width: int, minibatch: int, quick: bool) -> dict:
    batch = 4 * minibatch  # num_steps = minibatch: 4 envs x num_steps / 4 minibatches
    epochs = 2 if quick else max(2, 20_480 // batch)
    return {
        "activation": "relu",
        "hidden": width,
        "num_steps": minibatch,
        "total_timesteps": epochs * batch,
        "update_epochs": 1 if quick else 4,
    }


def grid(quick: bool) -> list[tuple[int, int]]:
    if quick:
        return [(64, 128)]
    widths = [(w, 128) for w in (64, 256, 1024)]
    return widths + [(64, m) for m in (512, 1024, 4096)] + [(256, 4096)]


def probe_cost(
    width: int, minibatch: int, quick: bool, note: str = "", **extra: Any
) -> ab.Comparison:
    """No probes against the five probes (and the case parameters ``extra``) at one
    width and minibatch size."""
    return ab.adding(
        f"width {width}, minibatch {minibatch}{note}",
        ab.Side("no probes", "ours", setting(width, minibatch, quick)),
        "probes",
        target="<= 1.05",
        probes=True,
        **extra,
    )


def comparisons(quick: bool) -> list[ab.Comparison]:
    out = [probe_cost(width, mb, quick) for width, mb in grid(quick)]
    width = 64 if quick else 1024  # the Fisher's per-parameter matmul grows with width
    return out + [probe_cost(width, 128, quick, ", fisher param_every=4", fisher_param_every=4)]


def memory(quick: bool) -> dict:
    """Tracker bytes per epoch for a run and a run four times longer."""
    out = {}
    for epochs in (1, 2) if quick else (10, 40):
        params = {"activation": "relu", "probes": True, "total_timesteps": epochs * 512}
        out[f"{epochs} epochs"] = ab.run_case("ours", params)["tracker_bytes_per_epoch"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = ab.parse_args(__doc__.splitlines()[0], 3, "scaling.json", argv)
    comps = comparisons(args.quick)
    ab.interleave(comps, args.repeats)
    mem = memory(args.quick)
    ab.print_table("probe overhead by width and minibatch", comps)
    for label, per_epoch in mem.items():
        print(f"tracker bytes per epoch, {label}: min {min(per_epoch)} max {max(per_epoch)}")
    ab.write_results(
        args.out,
        "scaling: t(probes)/t(no probes) by width and minibatch; tracker memory",
        comps,
        tracker_bytes_per_epoch=mem,
    )


if __name__ == "__main__":
    main()
