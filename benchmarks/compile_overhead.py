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
The update phases after the first epoch (``update_seconds``) give the steady state: their
B/A ratio per pair is written as ``steady_update_ratios_b_over_a``.

    python -m benchmarks.compile_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
        [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.ab import (
    Comparison,
    Side,
    parse_args,
    print_table,
    run_case,
    summary,
    write_results,
)

#: ``--only`` keys, in the order the comparisons run
KEYS = ["default", "every", "compile", "every_eager"]


def comparisons(
    quick: bool, only: list[str] | None = None, backend: str = "inductor"
) -> list[Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    compiled = dict(base, compile=True, compile_backend=backend)
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


def steady_update_ratios(comparison: dict) -> list[float]:
    """B / A per pair of the update phases' seconds after the first epoch (which holds
    the compile): the steady-state cost of the update, where probes and compiling act."""
    pairs = zip(comparison["extra_a"], comparison["extra_b"], strict=True)
    return [
        sum(b["update_seconds"][1:]) / sum(a["update_seconds"][1:])
        if len(a["update_seconds"]) > 1
        else float("nan")  # a one-epoch (--quick) run has no steady state
        for a, b in pairs
    ]


def main(argv: list[str] | None = None) -> None:
    backend = argparse.ArgumentParser(add_help=False)
    backend.add_argument("--backend", default="inductor", help="torch.compile backend")
    chosen, rest = backend.parse_known_args(argv)
    args = parse_args(__doc__.splitlines()[0], 6, "compile_overhead.json", rest, KEYS)
    comps = comparisons(args.quick, args.only, chosen.backend)
    for r in range(args.repeats):  # ab.interleave, written after every round
        for comp in comps:
            order = (comp.a, comp.b) if r % 2 == 0 else (comp.b, comp.a)
            results = {side.label: run_retrying(side) for side in order}
            ra, rb = results[comp.a.label], results[comp.b.label]
            comp.seconds_a.append(ra.pop("seconds"))
            comp.seconds_b.append(rb.pop("seconds"))
            comp.extra_a.append(ra)
            comp.extra_b.append(rb)
            print(f"[{r + 1}/{args.repeats}] {comp.name}: ratio {comp.ratios[-1]:.3f}", flush=True)
        record(args.out, comps)
    print_table("compiled policies: wall time B / A", comps)
    for comp in json.loads(args.out.read_text())["comparisons"]:
        ratio = comp["median_steady_update_ratio_b_over_a"]
        print(f"{comp['name']}: update phases after epoch 1, B/A {ratio:.3f}")


def run_retrying(side: Side) -> dict:
    """One measurement; run again once if the process failed (a shared machine's
    processes are sometimes killed from outside)."""
    try:
        return run_case(side.case, side.params)
    except RuntimeError as exc:
        print(f"retrying {side.label}: {str(exc).splitlines()[0]}", flush=True)
        return run_case(side.case, side.params)


def record(path: Path, comps: list[Comparison]) -> None:
    write_results(path, "compile overhead: t(B)/t(A)", comps, overhead=summary(comps))
    payload = json.loads(path.read_text())
    for comp in payload["comparisons"]:
        ratios = steady_update_ratios(comp)
        comp["steady_update_ratios_b_over_a"] = ratios
        comp["median_steady_update_ratio_b_over_a"] = statistics.median(ratios)
    path.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
