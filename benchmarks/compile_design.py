"""How probes should meet ``torch.compile``: the measurement that chose the design.

A hook on the second ReLU of a compiled 64-64 ReLU MLP (minibatch 128, Adam) reads the
activation and, through a tensor hook, its gradient, in two designs: ``traced`` (the
hook's body under ``torch.compiler.disable``: dynamo traces the module call and breaks
the graph at the hook) and ``eager`` (the shipped design, :mod:`policy_probes.compiled`:
the observed pass runs under ``torch.compiler.set_stance("force_eager")``). Per design and
observation rate (:data:`RATES`) a fresh process trains ``--passes`` passes and reports
milliseconds per pass after the first 20 and dynamo's counts; processes run interleaved,
``--repeats`` each, and the table gives medians (docs/compile.md).

    python -m benchmarks.compile_design [--backend inductor] [--repeats 5] [--passes 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.ab import RESULTS, json_result, machine

RATES = {"every": 1, "every_4": 4, "first_only": 10**9}


def measure(design: str, every: int, backend: str, passes: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
    )
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    fwd = torch.compile(model, backend=backend)
    x, y = torch.randn(128, 4), torch.randint(0, 3, (128,))
    sums = torch.zeros(2, 64)

    def record_grad(g: torch.Tensor) -> None:
        sums[1].add_(g.square().sum(0))

    def body(_m: nn.Module, _i: tuple, out: torch.Tensor) -> None:
        sums[0].add_((out.detach() > 0).sum(0))
        if out.requires_grad:
            out.register_hook(record_grad)

    hook = torch.compiler.disable(body) if design == "traced" else body
    target = model[3]
    state: dict = {"handle": None, "stance": None}

    def arm(on: bool) -> None:
        if on and state["handle"] is None:
            state["handle"] = target.register_forward_hook(hook)
            if design == "eager":
                state["stance"] = torch.compiler.set_stance("force_eager")
        elif not on and state["handle"] is not None:
            state["handle"].remove()
            state["handle"] = None
            if state["stance"] is not None:
                state["stance"].__exit__(None, None, None)
                state["stance"] = None

    start = 0.0
    for p in range(passes):
        if p == 20:
            start = time.perf_counter()
        arm(p % every == 0)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(fwd(x), y).backward()
        opt.step()
    ms = (time.perf_counter() - start) / (passes - 20) * 1e3
    arm(False)
    return {
        "ms_per_pass": ms,
        "frames": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "observed_sum": float(sums[0].sum()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--out", default=str(RESULTS / "compile_design.json"))
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # design rate (a child)
    args = parser.parse_args(argv)
    if args.one:
        design, rate = args.one
        print(json.dumps(measure(design, RATES[rate], args.backend, args.passes)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):
        for rate in RATES:
            for design in ("traced", "eager") if r % 2 == 0 else ("eager", "traced"):
                cmd = [sys.executable, "-m", "benchmarks.compile_design", "--one", design, rate]
                cmd += ["--backend", args.backend, "--passes", str(args.passes)]
                key = f"{design}/{rate}"
                runs.setdefault(key, []).append(json_result(cmd, env, key))
                print(f"[{r + 1}/{args.repeats}] {key}: {runs[key][-1]}")
    table = {
        key: {
            "median_ms_per_pass": statistics.median(x["ms_per_pass"] for x in vals),
            "ms_per_pass": [x["ms_per_pass"] for x in vals],
            "frames": vals[0]["frames"],
            "graphs": vals[0]["graphs"],
            "graph_breaks": vals[0]["graph_breaks"],
        }
        for key, vals in runs.items()
    }
    for key, row in table.items():
        print(
            f"{key:20s} {row['median_ms_per_pass']:.3f} ms/pass  frames {row['frames']}  "
            f"graphs {row['graphs']}  graph breaks {row['graph_breaks']}"
        )
    payload = {"title": "compile design", "machine": machine(), "backend": args.backend}
    with open(args.out, "w") as f:
        json.dump({**payload, "passes": args.passes, "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
