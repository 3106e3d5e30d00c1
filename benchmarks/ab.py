"""Interleaved A/B timing: A B A B ... in fresh subprocesses, median of paired ratios.

Each measurement runs ``python -m benchmarks.cases CASE PARAMS`` in its own process (one
torch thread, nothing shared with the other side) and reads back the JSON line the case
prints. Pairs are adjacent in time, so drifts of the machine (other load, thermal state)
hit both sides alike; the median of the per-pair ratios is the reported figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class Side:
    """One side of a comparison: a case of :mod:`benchmarks.cases` and its parameters."""

    label: str
    case: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Comparison:
    name: str
    a: Side
    b: Side
    target: str = ""
    seconds_a: list[float] = field(default_factory=list)
    seconds_b: list[float] = field(default_factory=list)
    extra_a: list[dict] = field(default_factory=list)
    extra_b: list[dict] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """b / a per adjacent pair (wall time: > 1 means B is slower)."""
        return [b / a for a, b in zip(self.seconds_a, self.seconds_b, strict=False)]

    @property
    def cpu_ratios(self) -> list[float]:
        """b / a of the CPU seconds per pair (where the cases report them)."""
        return [
            eb["cpu_seconds"] / ea["cpu_seconds"]
            for ea, eb in zip(self.extra_a, self.extra_b, strict=False)
            if "cpu_seconds" in ea and "cpu_seconds" in eb
        ]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "a": asdict(self.a),
            "b": asdict(self.b),
            "target": self.target,
            "median_seconds_a": statistics.median(self.seconds_a) if self.seconds_a else None,
            "median_seconds_b": statistics.median(self.seconds_b) if self.seconds_b else None,
            "ratios_b_over_a": self.ratios,
            "median_ratio_b_over_a": self.median_ratio,
            "cpu_ratios_b_over_a": self.cpu_ratios,
            "median_cpu_ratio_b_over_a": (
                statistics.median(self.cpu_ratios) if self.cpu_ratios else None
            ),
            "extra_a": self.extra_a,
            "extra_b": self.extra_b,
        }


#: run cases in this interpreter instead of a fresh one (``--inprocess``; smoke tests only:
#: the sides then share imports, caches and allocator state, so timings are not comparable)
IN_PROCESS = False


def json_result(
    cmd: list[str], env: dict[str, str], what: str, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``cmd`` in the repository root and return the last JSON line it printed;
    ``RuntimeError`` naming ``what`` with the end of its stderr when it fails."""
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_case(case: str, params: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its JSON result."""
    if IN_PROCESS:
        from benchmarks import cases

        cases.warm_imports(case)
        return json.loads(json.dumps(cases.CASES[case](dict(cases.DEFAULTS, **params))))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_SILENT="true")
    env.setdefault("WANDB_MODE", "offline")
    cmd = [sys.executable, "-m", "benchmarks.cases", case, json.dumps(params)]
    return json_result(cmd, env, f"case {case} {params}", timeout)


def interleave(
    comparisons: list[Comparison],
    repeats: int,
    log: Any = print,
    run: Callable[[Side], dict[str, Any]] | None = None,
    after_round: Callable[[], None] | None = None,
) -> None:
    """Fill every comparison with ``repeats`` A/B pairs, alternating which side goes first;
    ``run`` measures a side (default :func:`run_case`), ``after_round`` is called after
    every round of pairs."""
    run = run or (lambda side: run_case(side.case, side.params))
    for r in range(repeats):
        for comp in comparisons:
            order = (comp.a, comp.b) if r % 2 == 0 else (comp.b, comp.a)
            results = {side.label: run(side) for side in order}
            ra, rb = results[comp.a.label], results[comp.b.label]
            comp.seconds_a.append(ra["seconds"])
            comp.seconds_b.append(rb["seconds"])
            comp.extra_a.append({k: v for k, v in ra.items() if k != "seconds"})
            comp.extra_b.append({k: v for k, v in rb.items() if k != "seconds"})
            log(
                f"[{r + 1}/{repeats}] {comp.name}: {comp.a.label} {ra['seconds']:.3f}s  "
                f"{comp.b.label} {rb['seconds']:.3f}s  ratio {rb['seconds'] / ra['seconds']:.3f}"
            )
        if after_round:
            after_round()


def machine() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(path: Path, payload: dict[str, Any], indent: int | None = 2) -> None:
    """``payload`` as JSON (and a newline) at ``path``, its folder created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent) + "\n")


def write_results(path: Path, title: str, comparisons: list[Comparison], **extra: Any) -> None:
    payload = {"title": title, "machine": machine(), "comparisons": [c.row() for c in comparisons]}
    write_json(path, {**payload, **extra})


def adding(name: str, a: Side, b_label: str, target: str = "", **params: Any) -> Comparison:
    """A comparison whose side B runs side A's case with A's parameters and ``params`` on
    top: what switching something on costs."""
    return Comparison(name, a, Side(b_label, a.case, dict(a.params, **params)), target=target)


def atari_params(quick: bool, total_timesteps: int) -> dict[str, Any]:
    """The ``ours`` case on the Atari recipe's workload: Breakout, the NatureCNN encoder,
    clipped rewards, 8 envs x 128 steps (2 x 64 and 128 steps when ``quick``)."""
    return {
        "env_id": "ALE/Breakout-v5",
        "encoder": "nature_cnn",
        "clip_reward": 1.0,
        "num_envs": 2 if quick else 8,
        "num_steps": 64 if quick else 128,
        "total_timesteps": 128 if quick else total_timesteps,
    }


def measure_and_record(
    args: Any,
    comparisons: list[Comparison],
    what: str,
    *,
    table_title: str | None = None,
    results_title: str | None = None,
    ratios: str = "overhead",
    ratio_label: str = "B/A wall time",
) -> None:
    """Run the comparisons interleaved (``args.repeats`` pairs), print the table and write
    ``args.out`` with every comparison's median ratio under ``ratios``. The titles default
    to ``what (wall time with / without)`` over the table and ``what: t(B)/t(A)`` in the
    results."""
    interleave(comparisons, args.repeats)
    print_table(table_title or f"{what} (wall time with / without)", comparisons, ratio_label)
    results_title = results_title or f"{what}: t(B)/t(A)"
    write_results(args.out, results_title, comparisons, **{ratios: summary(comparisons)})


def print_table(
    title: str, comparisons: list[Comparison], ratio_label: str = "B/A wall time"
) -> None:
    from rich.console import Console
    from rich.table import Table

    header = ("comparison", "A", "B", "median A (s)", "median B (s)", ratio_label)
    table = Table(*header, "CPU-time ratio", "pairs", "target", title=title)
    for c in comparisons:
        table.add_row(
            c.name,
            c.a.label,
            c.b.label,
            f"{statistics.median(c.seconds_a):.3f}",
            f"{statistics.median(c.seconds_b):.3f}",
            f"{c.median_ratio:.3f}",
            f"{statistics.median(c.cpu_ratios):.3f}" if c.cpu_ratios else "-",
            str(len(c.ratios)),
            c.target,
        )
    Console().print(table)


def parse_args(
    description: str,
    default_repeats: int,
    default_out: str,
    argv: list[str] | None = None,
    comparison_keys: list[str] | None = None,
    default_keys: list[str] | None = None,
) -> Any:
    """The command line every A/B script shares: ``--quick``, ``--repeats``, ``--out``,
    ``--inprocess``; with ``comparison_keys`` also ``--only KEY,...`` (``args.only``: the
    keys chosen, ``default_keys`` or all by default; a subset written to the default place
    goes to ``NAME_KEY_....json`` beside it, so that it never replaces the full results)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny runs, one pair each (a smoke test of the script, not a measurement)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"A/B pairs per comparison ({default_repeats})"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / default_out, help="where to write the JSON"
    )
    parser.add_argument(
        "--inprocess",
        action="store_true",
        help="run the cases in this process (smoke tests; timings not comparable)",
    )
    if comparison_keys:
        parser.add_argument(
            "--only",
            default=",".join(default_keys or comparison_keys),
            help=f"comma-separated subset of the comparisons {comparison_keys}",
        )
    args = parser.parse_args(argv)
    if comparison_keys:
        args.only = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = sorted(set(args.only) - set(comparison_keys))
        if unknown:
            parser.error(f"unknown comparison(s) {unknown}; choose from {comparison_keys}")
        if args.only != (default_keys or comparison_keys) and args.out == RESULTS / default_out:
            args.out = RESULTS / f"{Path(default_out).stem}_{'_'.join(args.only)}.json"
    if args.inprocess:
        global IN_PROCESS
        IN_PROCESS = True
    if args.repeats is None:
        args.repeats = 1 if args.quick else default_repeats
    return args


def summary(comparisons: list[Comparison]) -> dict[str, float]:
    """``name -> median B/A ratio`` for the results JSON's quick-look section."""
    return {c.name: c.median_ratio for c in comparisons}
