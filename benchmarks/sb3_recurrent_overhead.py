"""SB3 RecurrentPPO overhead: sb3-contrib's RecurrentPPO with the ProbeCallback against it
without the callback.

Both sides train ``RecurrentPPO("MlpLstmPolicy")`` on CartPole-v1 with the hyperparameters
of the SB3 overhead benchmark (4 envs x 128 steps, minibatches of 128, 4 update epochs,
64-unit LSTMs and 64-64 ReLU actor and critic MLPs, CPU, one torch thread). Side B adds
``ProbeCallback`` with the five module probes on ``actor_mlp`` and ``critic_mlp`` and
relu, saturation, Fisher and gradient flow on ``lstm_actor`` and ``lstm_critic``, which
also reads the padding mask of every minibatch (the row-mask path of every probe).
Same A/B harness as the other benchmarks (:mod:`benchmarks.ab`).

    python -m benchmarks.sb3_recurrent_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, measure_and_record, parse_args
from benchmarks.sb3_overhead import callback_overhead


def comparisons(quick: bool) -> list[Comparison]:
    base = {
        "total_timesteps": 512 if quick else 4096,
        "activation": "relu",
        "recurrent": True,
    }
    return [
        callback_overhead(
            "SB3 RecurrentPPO + ProbeCallback (18 probes, masked rows)", "recurrent ppo", base
        )
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 3, "sb3_recurrent_overhead.json", argv)
    measure_and_record(args, comparisons(args.quick), "sb3 recurrent overhead")


if __name__ == "__main__":
    main()
