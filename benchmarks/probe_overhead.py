"""Benchmark 2: probe overhead (target: <= 1.05x wall time), and W&B's gradient watching.

The five module probes on ``actor_mlp`` and ``critic_mlp`` of a ReLU policy at every
training step against the same run without probes (``mlp``); per-layer reporting off
against on (``per_layer``, also ``benchmarks.per_layer_overhead``); W&B's
``wandb.watch(log="all", log_freq=1)`` as the reference (``wandb``, a shorter run); the
Atari recipe's probes on Breakout (``atari``); and the plasticity measures at every pass
and at ``probe_budget=0.05`` (``plasticity``, ``plasticity_budget``; run when asked).

    python -m benchmarks.probe_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, adding, atari_params, measure_and_record, parse_args

#: ``--only`` keys, in the order the comparisons run
KEYS = ["mlp", "per_layer", "wandb", "atari", "plasticity", "plasticity_budget"]
#: what runs without ``--only``
DEFAULT_KEYS = ["mlp", "per_layer", "wandb", "atari"]


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    plain = Side("no probes", "ours", dict(base))
    short = dict(base, total_timesteps=512 if quick else 4096)  # wandb.watch is slow
    atari = atari_params(quick, total_timesteps=2048)
    plasticity = {"probes": True, "probe_set": "plasticity"}
    comps = {
        "mlp": adding("five probes x 2 components", plain, "probes", target="<= 1.05", probes=True),
        "per_layer": per_layer_comparison(quick),
        "plasticity": adding(
            "plasticity probes (every pass)", plain, "probes", "cost reported", **plasticity
        ),
        "plasticity_budget": Comparison(
            "plasticity probes (probe_budget=0.05)",
            Side("no probes", "ours", dict(base, probe_budget=0.05)),
            Side("probes", "ours", dict(base, **plasticity, probe_budget=0.05)),
            target="cost reported",
        ),
        "wandb": Comparison(
            "wandb.watch(log='all', log_freq=1)",
            Side("no probes", "ours", dict(short)),
            Side("wandb.watch", "ours", dict(short, wandb_watch=True)),
            target="reference",
        ),
        "atari": adding(
            "atari recipe probes (NatureCNN)",
            Side("no probes", "ours", dict(atari)),
            "probes",
            "measured",
            probes=True,
        ),
    }
    return [comps[k] for k in (only or KEYS)]


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
    args = parse_args(__doc__.splitlines()[0], 5, "probe_overhead.json", argv, KEYS, DEFAULT_KEYS)
    measure_and_record(args, comparisons(args.quick, args.only), "probe overhead")


if __name__ == "__main__":
    main()
