"""SB3 RecurrentPPO overhead: sb3-contrib's RecurrentPPO with the ProbeCallback against it
without the callback.

``RecurrentPPO("MlpLstmPolicy")`` on CartPole-v1 with the SB3 overhead benchmark's
settings and 64-unit LSTMs; side B's callback also probes ``lstm_actor`` and
``lstm_critic`` (:func:`benchmarks.cases.recurrent_probe_builders`) and reads the padding
mask of every minibatch.

    python -m benchmarks.sb3_recurrent_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, measure_and_record, parse_args
from benchmarks.sb3_overhead import callback_overhead


def comparisons(quick: bool) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 4096, "activation": "relu", "recurrent": True}
    name = "SB3 RecurrentPPO + ProbeCallback (18 probes, masked rows)"
    return [callback_overhead(name, "recurrent ppo", base)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 3, "sb3_recurrent_overhead.json", argv)
    measure_and_record(args, comparisons(args.quick), "sb3 recurrent overhead")


if __name__ == "__main__":
    main()
