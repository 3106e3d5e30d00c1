"""SB3 overhead: Stable-Baselines3 PPO with the ProbeCallback against SB3 without it.

SB3 PPO on CartPole-v1 with the throughput benchmark's hyperparameters and a ReLU
network; side B adds ``ProbeCallback`` with the five module probes on ``actor_mlp`` and
``critic_mlp`` (:func:`benchmarks.cases.probe_builders`).

    python -m benchmarks.sb3_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, adding, measure_and_record, parse_args


def callback_overhead(name: str, label: str, base: dict) -> Comparison:
    """SB3's run ``label`` with the parameters ``base`` against the same run with the
    ProbeCallback."""
    target = "<= 1.05 (as for our trainer)"
    side = Side(label, "sb3", dict(base))
    return adding(name, side, f"{label} + ProbeCallback", target=target, probe_callback=True)


def comparisons(quick: bool) -> list[Comparison]:
    base = {"total_timesteps": 1024 if quick else 32_768, "activation": "relu"}
    return [callback_overhead("SB3 PPO + ProbeCallback (five probes x 2 components)", "sb3", base)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 5, "sb3_overhead.json", argv)
    measure_and_record(args, comparisons(args.quick), "sb3 overhead")


if __name__ == "__main__":
    main()
