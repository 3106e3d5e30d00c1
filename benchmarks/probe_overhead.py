"""Benchmark 2: probe overhead (target: <= 1.05x wall time), and W&B's gradient watching.

All five module probes of the core toolkit (relu, saturation_tanh, fisher,
gradient_flow, relu_gradient_flow) on ``actor_mlp`` and ``critic_mlp``, recording at
every training step (default ``phases=("train",)``: every minibatch forward and
backward), against the same run without probes. The policy uses ReLU: the
relu_gradient_flow probe needs ``nn.ReLU`` modules and refuses to attach to the default
tanh policy. Everything else is the throughput benchmark's CartPole setup.

The third row prices per-layer reporting: the same five probes with ``per_layer=False``
(the component outputs only) against the default ``per_layer=True`` (also every hidden
layer inside actor_mlp and critic_mlp: relu, gradient_flow and relu_gradient_flow on
layer_0 and layer_1; saturation_tanh finds no tanh layer in the ReLU policy).
``python -m benchmarks.per_layer_overhead`` runs that row alone.

The reference row is W&B's ``wandb.watch(policy, log="all", log_freq=1)`` (offline mode)
on the same trainer, with no probes, over 4096 steps instead of 20480 (it is slow).

    python -m benchmarks.probe_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, interleave, parse_args, print_table, write_results


def comparisons(quick: bool) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    plain = Side("no probes", "ours", dict(base))
    # wandb.watch histograms every parameter and gradient at every step: a much shorter
    # run (8 epochs) keeps the reference row affordable; the ratio is what counts.
    short = dict(base, total_timesteps=512 if quick else 4096)
    return [
        Comparison(
            "five probes x 2 components",
            plain,
            Side("probes", "ours", dict(base, probes=True)),
            target="<= 1.05",
        ),
        per_layer_comparison(quick),
        Comparison(
            "wandb.watch(log='all', log_freq=1)",
            Side("no probes", "ours", dict(short)),
            Side("wandb.watch", "ours", dict(short, wandb_watch=True)),
            target="reference",
        ),
    ]


def per_layer_comparison(quick: bool) -> Comparison:
    """Five probes x 2 components, per_layer off (A) against on (B, the default)."""
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu", "probes": True}
    return Comparison(
        "five probes: per_layer off -> on",
        Side("per_layer=False", "ours", dict(base, per_layer=False)),
        Side("per_layer=True", "ours", dict(base, per_layer=True)),
        target="cost reported",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 5, "probe_overhead.json", argv)
    comps = comparisons(args.quick)
    interleave(comps, args.repeats)
    print_table("probe overhead (wall time with / without)", comps)
    write_results(
        args.out,
        "probe overhead: t(B)/t(A)",
        comps,
        overhead={c.name: c.median_ratio for c in comps},
    )


if __name__ == "__main__":
    main()
