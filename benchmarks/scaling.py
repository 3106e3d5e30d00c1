"""Benchmark 3: probe overhead across hidden widths and minibatch sizes, and tracker memory.

Target: at most 1.05x everywhere, not growing with width or batch. Same setup as the
probe-overhead benchmark (ReLU policy, five probes on actor_mlp and critic_mlp, every
training step). Widths 64/256/1024 at minibatch 128; minibatch sizes 128/512/1024/4096
at width 64 (4 minibatches per rollout, so the rollout grows to 4 x the minibatch:
``num_steps`` = minibatch with 4 envs); and width 256 x minibatch 4096. (Width 1024 x
minibatch 4096 costs about a minute per run on one core; add it to ``grid`` on a
faster machine.) Width 1024 also runs with ``attach_fisher_information_hooks(param_every=4)``.
Each run lasts 20480 steps or at least 2 rollouts.

Memory: the probe run's ``tracker_bytes_per_epoch`` (accumulators + row buffers after
each epoch's collection) for a run and for a run four times longer; constant across
epochs and equal for both lengths means memory does not grow with the number of steps.

    python -m benchmarks.scaling [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from typing import Any

from benchmarks.ab import (
    Comparison,
    Side,
    adding,
    interleave,
    parse_args,
    print_table,
    run_case,
    write_results,
)


def setting(width: int, minibatch: int, quick: bool) -> dict:
    num_steps = minibatch  # 4 envs x num_steps / 4 minibatches = num_steps
    batch = 4 * num_steps
    epochs = 2 if quick else max(2, 20_480 // batch)
    return {
        "activation": "relu",
        "hidden": width,
        "num_steps": num_steps,
        "total_timesteps": epochs * batch,
        "update_epochs": 1 if quick else 4,
    }


def grid(quick: bool) -> list[tuple[int, int]]:
    if quick:
        return [(64, 128)]
    widths = [(w, 128) for w in (64, 256, 1024)]
    batches = [(64, m) for m in (512, 1024, 4096)]
    return widths + batches + [(256, 4096)]


def probe_cost(width: int, minibatch: int, quick: bool, note: str = "", **extra: Any) -> Comparison:
    """No probes against the five probes (and the case parameters ``extra``) at one
    width and minibatch size."""
    return adding(
        f"width {width}, minibatch {minibatch}{note}",
        Side("no probes", "ours", setting(width, minibatch, quick)),
        "probes",
        target="<= 1.05",
        probes=True,
        **extra,
    )


def comparisons(quick: bool) -> list[Comparison]:
    out = [probe_cost(width, mb, quick) for width, mb in grid(quick)]
    # the per-parameter Fisher's extra matmul is the cost that grows with width:
    # the same widest setting with the Fisher's parameters from every 4th pass
    width = 64 if quick else 1024
    out.append(probe_cost(width, 128, quick, ", fisher param_every=4", fisher_param_every=4))
    return out


def memory(quick: bool) -> dict:
    """Tracker bytes per epoch for a run and a run four times longer."""
    out = {}
    for epochs in (1, 2) if quick else (10, 40):
        r = run_case(
            "ours",
            {"activation": "relu", "probes": True, "total_timesteps": epochs * 512},
        )
        out[f"{epochs} epochs"] = r["tracker_bytes_per_epoch"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 3, "scaling.json", argv)
    comps = comparisons(args.quick)
    interleave(comps, args.repeats)
    mem = memory(args.quick)
    print_table("probe overhead by width and minibatch", comps)
    for label, per_epoch in mem.items():
        print(f"tracker bytes per epoch, {label}: min {min(per_epoch)} max {max(per_epoch)}")
    write_results(
        args.out,
        "scaling: t(probes)/t(no probes) by width and minibatch; tracker memory",
        comps,
        tracker_bytes_per_epoch=mem,
    )


if __name__ == "__main__":
    main()
