"""Benchmark: probes on a compiled policy (``trainer.compile=true``, inductor), against the
same compiled run without probes, and compiled against eager training.

The probe-overhead benchmark's CartPole setup (ReLU policy, the five module probes on
``actor_mlp`` and ``critic_mlp``, 40 epochs); ``--only`` keys: ``default`` (compiled,
probes at ``probe_budget=0.05``, against compiled without probes), ``every`` (the same at
every pass), ``compile`` (compiled against eager, no probes) and ``every_eager`` (probes on
every pass, compiled against eager). The timed region includes compiling; the update
phases after the first epoch give the steady state (``steady_update_ratios_b_over_a``).
Results are written after every round.

    python -m benchmarks.compile_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
        [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

from benchmarks import ab

#: ``--only`` keys, in the order the comparisons run
KEYS = ["default", "every", "compile", "every_eager"]


def comparisons(
    quick: bool, only: list[str] | None = None, backend: str = "inductor"
) -> list[ab.Comparison]:
    base = {"total_timesteps": 512 if quick else 20_480, "activation": "relu"}
    compiled = dict(base, compile=True, compile_backend=backend)
    every = {"probes": True, "probe_budget": None, "probe_schedule": None}
    plain = ab.Side("compiled, no probes", "ours", compiled)
    probed = ab.Side("compiled, probes every pass", "ours", dict(compiled, **every))
    comps = {
        "default": ab.adding(
            "compiled: five probes x 2 at the default budget",
            plain,
            "compiled, probes (budget 0.05)",
            "<= 1.05",
            probes=True,
            probe_budget=0.05,
        ),
        "every": ab.Comparison(
            "compiled: five probes x 2 on every pass", plain, probed, "measured"
        ),
        "compile": ab.Comparison(
            "compiled vs eager, no probes",
            ab.Side("eager", "ours", dict(base)),
            ab.Side("compiled", "ours", compiled),
            "measured",
        ),
        "every_eager": ab.Comparison(
            "probes on every pass: compiled vs eager",
            ab.Side("eager, probes every pass", "ours", dict(base, **every)),
            probed,
            "measured",
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
    args = ab.parse_args(__doc__.splitlines()[0], 6, "compile_overhead.json", rest, KEYS)
    comps = comparisons(args.quick, args.only, chosen.backend)
    log = partial(print, flush=True)
    ab.interleave(comps, args.repeats, log, run_retrying, lambda: record(args.out, comps))
    ab.print_table("compiled policies: wall time B / A", comps)
    for comp in json.loads(args.out.read_text())["comparisons"]:
        ratio = comp["median_steady_update_ratio_b_over_a"]
        print(f"{comp['name']}: update phases after epoch 1, B/A {ratio:.3f}")


def run_retrying(side: ab.Side) -> dict:
    """One measurement; run again once if the process failed (a shared machine's
    processes are sometimes killed from outside)."""
    try:
        return ab.run_case(side.case, side.params)
    except RuntimeError as exc:
        print(f"retrying {side.label}: {str(exc).splitlines()[0]}", flush=True)
        return ab.run_case(side.case, side.params)


def record(path: Path, comps: list[ab.Comparison]) -> None:
    """The results so far, with the steady-state update ratios of every comparison."""
    payload = {"title": "compile overhead: t(B)/t(A)", "machine": ab.machine()}
    payload |= {"comparisons": [c.row() for c in comps], "overhead": ab.summary(comps)}
    for comp in payload["comparisons"]:
        ratios = steady_update_ratios(comp)
        comp["steady_update_ratios_b_over_a"] = ratios
        comp["median_steady_update_ratio_b_over_a"] = statistics.median(ratios)
    ab.write_json(path, payload)


if __name__ == "__main__":
    main()
