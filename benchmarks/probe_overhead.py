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

The ``plasticity`` rows price the plasticity measures of issue 24 (weights, preactivation
and utility on both MLPs, churn on both heads) at every pass and at ``probe_budget=0.05``.

The reference row is W&B's ``wandb.watch(policy, log="all", log_freq=1)`` (offline mode)
on the same trainer, with no probes, over 4096 steps instead of 20480 (it is slow).

The ``atari`` comparison: the atari recipe's probes (relu on every NatureCNN encoder layer,
fisher and gradient_flow on every encoder layer and both heads) on ALE/Breakout-v5, 8
envs x 128 steps, 2 epochs (a CNN on one CPU thread is slow: the run is kept short).

    python -m benchmarks.probe_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, adding, atari_params, measure_and_record, parse_args

#: ``--only`` keys, in the order the comparisons run
KEYS = ["mlp", "per_layer", "wandb", "atari", "plasticity", "plasticity_budget"]
#: what runs without ``--only`` (the plasticity rows run when asked)
DEFAULT_KEYS = ["mlp", "per_layer", "wandb", "atari"]


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    plain = Side("no probes", "ours", dict(base))
    # wandb.watch histograms every parameter and gradient at every step: a much shorter
    # run (8 epochs) keeps the reference row affordable; the ratio is what counts.
    short = dict(base, total_timesteps=512 if quick else 4096)
    atari = atari_params(quick, total_timesteps=2048)
    comps = {
        "mlp": adding("five probes x 2 components", plain, "probes", target="<= 1.05", probes=True),
        "per_layer": per_layer_comparison(quick),
        # the plasticity measures (weights, preactivation, utility, churn): every pass,
        # and at the toolkit's default overhead budget
        "plasticity": adding(
            "plasticity probes (every pass)",
            plain,
            "probes",
            target="cost reported",
            probes=True,
            probe_set="plasticity",
        ),
        "plasticity_budget": Comparison(
            "plasticity probes (probe_budget=0.05)",
            Side("no probes", "ours", dict(base, probe_budget=0.05)),
            Side(
                "probes", "ours", dict(base, probes=True, probe_set="plasticity", probe_budget=0.05)
            ),
            target="cost reported",
        ),
        "wandb": Comparison(
            "wandb.watch(log='all', log_freq=1)",
            Side("no probes", "ours", dict(short)),
            Side("wandb.watch", "ours", dict(short, wandb_watch=True)),
            target="reference",
        ),
        "atari": Comparison(
            "atari recipe probes (NatureCNN)",
            Side("no probes", "ours", dict(atari)),
            Side("probes", "ours", dict(atari, probes=True)),
            target="measured",
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
