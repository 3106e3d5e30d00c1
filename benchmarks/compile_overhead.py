"""Benchmark: probes on a compiled policy (``trainer.compile=true``, inductor), against the
same compiled run without probes, and compiled against eager training.

The built-in trainer on CartPole (the throughput benchmark's setup with a ReLU policy:
4 envs x 128 steps, 4 minibatches, 4 update epochs, 40 epochs), the five module probes on
``actor_mlp`` and ``critic_mlp`` (as in ``benchmarks.probe_overhead``). Probes observe
their passes eagerly (``docs/compile.md``), so their price under compile is the eager
pass they take plus what the probes themselves cost:

* ``default``: compiled, probes at the toolkit's default (``probe_budget=0.05``) against
  compiled without probes (target <= 1.05);
* ``every``: compiled, probes on every pass (every pass then runs eagerly) against
  compiled without probes (measured);
* ``compile``: compiled against eager, both without probes (what compiling buys here);
* ``every_eager``: compiled with probes on every pass against eager with probes on every
  pass (the same eager passes: the difference is dynamo's dispatch to the eager code).

Each run reports the graphs dynamo compiled and the graph breaks it met (``extra``).
The timed region includes compiling (the first epoch): inductor's on-disk cache makes
later processes' compiles mostly cache hits, which is what a user's second run sees too.
``update_seconds`` (per epoch) gives the steady-state update phase.

    python -m benchmarks.compile_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from benchmarks.ab import Comparison, Side, measure_and_record, parse_args

#: ``--only`` keys, in the order the comparisons run
KEYS = ["default", "every", "compile", "every_eager"]


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    compiled = dict(base, compile=True, compile_backend="inductor")
    every = {"probes": True, "probe_budget": None, "probe_schedule": None}
    comps = {
        "default": Comparison(
            "compiled: five probes x 2 at the default budget",
            Side("compiled, no probes", "ours", compiled),
            Side(
                "compiled, probes (budget 0.05)",
                "ours",
                dict(compiled, probes=True, probe_budget=0.05),
            ),
            target="<= 1.05",
        ),
        "every": Comparison(
            "compiled: five probes x 2 on every pass",
            Side("compiled, no probes", "ours", compiled),
            Side("compiled, probes every pass", "ours", dict(compiled, **every)),
            target="measured",
        ),
        "compile": Comparison(
            "compiled vs eager, no probes",
            Side("eager", "ours", dict(base)),
            Side("compiled", "ours", compiled),
            target="measured",
        ),
        "every_eager": Comparison(
            "probes on every pass: compiled vs eager",
            Side("eager, probes every pass", "ours", dict(base, **every)),
            Side("compiled, probes every pass", "ours", dict(compiled, **every)),
            target="measured",
        ),
    }
    return [comps[k] for k in (only or KEYS)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 6, "compile_overhead.json", argv, KEYS)
    measure_and_record(
        args,
        comparisons(args.quick, args.only),
        "compiled policies: wall time B / A",
        "compile overhead: t(B)/t(A)",
    )


if __name__ == "__main__":
    main()
