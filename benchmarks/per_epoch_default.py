"""The per-epoch default against no probes, and every pass, on the four workloads of the
per-epoch issue: the cartpole recipe, SB3 PPO + ProbeCallback, the Atari recipe
(NatureCNN) and sb3-contrib RecurrentPPO + ProbeCallback.

Side B of every ``default`` comparison runs at the toolkit's default sampling (passes 0,
16, 32, ... of every epoch, every epoch reporting, the budget of 0.05 checked once):
``probe_budget=0.05`` given explicitly, because the cases' own default is every pass.
``every`` comparisons observe every pass (``probe_budget=None``).

Keys for ``--only``: ``recipe`` (the cartpole recipe as it ships, JSONL/CSV sinks,
evaluation and checkpoints, 51,200 steps = 100 epochs), ``recipe_headline`` (the same with
the console and offline W&B sinks on as well, as ``policy-probes run`` starts it; no
target of the issue, the cost a user of the headline command sees), ``recipe_floor`` (the
recipe with its four probes on ``actor_mlp`` alone and ``per_layer=False``: one row block
per probe and pass, the least any batching of layers and components could leave the report
of these probes to reduce; no target, a bound on the ``recipe`` target), ``sb3_floor``
(the same bound for ``sb3``: its five probes on ``actor_mlp`` alone, ``per_layer=False``;
the two bounds run only when named in ``--only``), ``sb3`` (SB3 PPO + ProbeCallback, five
probes x 2 components, 32,768 steps), ``atari`` (the Atari recipe's probes on the
NatureCNN PPO, Breakout, 8 envs x 128 steps, 4096 steps = 4 epochs), ``recurrent``
(RecurrentPPO + ProbeCallback, 18 probes on LSTMs and MLPs with the padding mask, 4096
steps), ``every_five`` (five probes x 2 on the CartPole MLPs at every pass, 20,480 steps)
and ``every_atari`` (the Atari recipe's probes at every pass). Same harness as every
benchmark (:mod:`benchmarks.ab`): fresh interpreters, A B / B A pairs, median of the
per-pair ratios.

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
    atari = atari_params(quick, total_timesteps=4096)
    recipe = Side("recipe, no probes", "recipe", {"total_timesteps": 4096 if quick else 51_200})
    headline = Side(
        "recipe with console and W&B, no probes",
        "recipe",
        {"total_timesteps": 4096 if quick else 51_200, "recipe_sinks": "headline"},
    )
    sb3 = Side("sb3", "sb3", {"total_timesteps": 1024 if quick else 32_768, "activation": "relu"})
    recurrent = Side(
        "recurrent ppo",
        "sb3",
        {"total_timesteps": 512 if quick else 4096, "activation": "relu", "recurrent": True},
    )
    five = Side(
        "no probes", "ours", {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    )
    comps = {
        "recipe": adding(
            "cartpole recipe, default", recipe, "recipe", "<= 1.05", probes=True, **DEFAULT
        ),
        "recipe_headline": adding(
            "cartpole recipe with console and W&B sinks, default",
            headline,
            "recipe",
            "-",
            probes=True,
            **DEFAULT,
        ),
        "recipe_floor": adding(
            "cartpole recipe, its four probes on one component, default",
            recipe,
            "four probes, actor_mlp alone",
            "-",
            probes=True,
            recipe_probes="one_component",
            **DEFAULT,
        ),
        "sb3": adding(
            "SB3 PPO + ProbeCallback, default",
            sb3,
            "+ ProbeCallback",
            "<= 1.05",
            probe_callback=True,
            **DEFAULT,
        ),
        "sb3_floor": adding(
            "SB3 PPO + ProbeCallback, five probes on one component, default",
            sb3,
            "+ ProbeCallback, actor_mlp alone",
            "-",
            probe_callback=True,
            per_layer=False,
            probe_components=["actor_mlp"],
            **DEFAULT,
        ),
        "atari": adding(
            "Atari recipe (NatureCNN), default",
            Side("no probes", "ours", atari),
            "probes",
            "<= 1.05",
            probes=True,
            **DEFAULT,
        ),
        "recurrent": adding(
            "RecurrentPPO + ProbeCallback, default",
            recurrent,
            "+ ProbeCallback",
            "<= 1.10",
            probe_callback=True,
            **DEFAULT,
        ),
        "every_five": adding(
            "five probes x 2 (CartPole MLPs), every pass",
            five,
            "probes",
            "<= 1.30",
            probes=True,
            **EVERY,
        ),
        "every_atari": adding(
            "Atari recipe (NatureCNN), every pass",
            Side("no probes", "ours", atari),
            "probes",
            "<= 1.50",
            probes=True,
            **EVERY,
        ),
    }
    return [comps[k] for k in (only or KEYS)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        __doc__.splitlines()[0], 6, "per_epoch_default.json", argv, KEYS, DEFAULT_KEYS
    )
    measure_and_record(args, comparisons(args.quick, args.only), "per-epoch default")


if __name__ == "__main__":
    main()
