"""The per-epoch default against no probes, and every pass, on the four workloads of the
per-epoch issue: the cartpole recipe, SB3 PPO + ProbeCallback, the Atari recipe
(NatureCNN) and sb3-contrib RecurrentPPO + ProbeCallback.

``default`` comparisons give the toolkit's default sampling explicitly
(``probe_budget=0.05``; the cases' own default is every pass), ``every_*`` ones observe
every pass. ``recipe_headline`` adds the console and offline W&B sinks; the bounds
``recipe_floor`` and ``sb3_floor`` (the probes on ``actor_mlp`` alone, no per-layer keys)
run only when named in ``--only``.

    python -m benchmarks.per_epoch_default [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, adding, atari_params, measure_and_record, parse_args

KEYS = [
    "recipe",
    "recipe_headline",
    "recipe_floor",
    "sb3",
    "sb3_floor",
    "atari",
    "recurrent",
    "every_five",
    "every_atari",
]
#: what a run without ``--only`` measures: the bounds run only when asked
DEFAULT_KEYS = [k for k in KEYS if not k.endswith("_floor")]
#: the toolkit's default sampling, given explicitly (the cases default to every pass)
DEFAULT = {"probe_budget": 0.05, "probe_schedule": None}
EVERY = {"probe_budget": None, "probe_schedule": None}


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    recipe_steps = {"total_timesteps": 4096 if quick else 51_200}
    recipe = Side("recipe, no probes", "recipe", recipe_steps)
    headline = Side(
        "recipe with console and W&B, no probes",
        "recipe",
        dict(recipe_steps, recipe_sinks="headline"),
    )
    relu = {"activation": "relu"}
    sb3 = Side("sb3", "sb3", {"total_timesteps": 1024 if quick else 32_768, **relu})
    recurrent = {"total_timesteps": 512 if quick else 4096, **relu, "recurrent": True}
    five = Side("no probes", "ours", {"total_timesteps": 512 if quick else 20_480, **relu})
    atari = Side("no probes", "ours", atari_params(quick, total_timesteps=4096))
    probes, callback = {"probes": True}, {"probe_callback": True}
    one = {"per_layer": False, "probe_components": ["actor_mlp"]}
    comps = {
        # key: (name, side A, label of B, target, what B adds)
        "recipe": ("cartpole recipe, default", recipe, "recipe", "<= 1.05", probes),
        "recipe_headline": (
            "cartpole recipe with console and W&B sinks, default",
            headline,
            "recipe",
            "-",
            probes,
        ),
        "recipe_floor": (
            "cartpole recipe, its four probes on one component, default",
            recipe,
            "four probes, actor_mlp alone",
            "-",
            dict(probes, recipe_probes="one_component"),
        ),
        "sb3": ("SB3 PPO + ProbeCallback, default", sb3, "+ ProbeCallback", "<= 1.05", callback),
        "sb3_floor": (
            "SB3 PPO + ProbeCallback, five probes on one component, default",
            sb3,
            "+ ProbeCallback, actor_mlp alone",
            "-",
            dict(callback, **one),
        ),
        "atari": ("Atari recipe (NatureCNN), default", atari, "probes", "<= 1.05", probes),
        "recurrent": (
            "RecurrentPPO + ProbeCallback, default",
            Side("recurrent ppo", "sb3", recurrent),
            "+ ProbeCallback",
            "<= 1.10",
            callback,
        ),
    }
    every = {
        "every_five": (
            "five probes x 2 (CartPole MLPs), every pass",
            five,
            "probes",
            "<= 1.30",
            probes,
        ),
        "every_atari": ("Atari recipe (NatureCNN), every pass", atari, "probes", "<= 1.50", probes),
    }
    made = {k: adding(*spec[:4], **spec[4], **DEFAULT) for k, spec in comps.items()}
    made.update({k: adding(*spec[:4], **spec[4], **EVERY) for k, spec in every.items()})
    return [made[k] for k in (only or KEYS)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        __doc__.splitlines()[0], 6, "per_epoch_default.json", argv, KEYS, DEFAULT_KEYS
    )
    measure_and_record(args, comparisons(args.quick, args.only), "per-epoch default")


if __name__ == "__main__":
    main()
