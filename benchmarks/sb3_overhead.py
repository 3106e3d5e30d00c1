"""SB3 overhead: Stable-Baselines3 PPO with the ProbeCallback against SB3 without it.

Both sides train SB3 PPO on CartPole-v1 with the hyperparameters of the throughput
benchmark (4 envs x 128 steps, minibatches of 128, 4 update epochs, 64-64 actor and
critic, CPU, one torch thread). Side B adds ``ProbeCallback`` with all five module probes
(relu, saturation_tanh, fisher, gradient_flow, relu_gradient_flow) on ``actor_mlp`` and
``critic_mlp``, writing one JSONL record per rollout/update cycle. The network uses ReLU
so that every probe has something to measure. Same A/B harness as the other benchmarks
(:mod:`benchmarks.ab`): fresh interpreters, A B A B, median paired ratio.

    python -m benchmarks.sb3_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, adding, measure_and_record, parse_args


def callback_overhead(name: str, label: str, base: dict) -> Comparison:
    """SB3's run ``label`` with the parameters ``base`` against the same run with the
    ProbeCallback."""
    return adding(
        name,
        Side(label, "sb3", dict(base)),
        f"{label} + ProbeCallback",
        target="<= 1.05 (as for our trainer)",
        probe_callback=True,
    )


def comparisons(quick: bool) -> list[Comparison]:
    base = {"total_timesteps": 1024 if quick else 32_768, "activation": "relu"}
    return [callback_overhead("SB3 PPO + ProbeCallback (five probes x 2 components)", "sb3", base)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 5, "sb3_overhead.json", argv)
    measure_and_record(args, comparisons(args.quick), "sb3 overhead")


if __name__ == "__main__":
    main()
