"""Run every benchmark of issue 6 with its default repeats (``make bench``).

Each script runs in its own process, one after the other (the machine should be
otherwise idle; every comparison is A/B interleaved anyway), and writes its JSON under
``benchmarks/results/``. ``--quick`` passes ``--quick`` to every script (a smoke run).

    python -m benchmarks.run_all [--quick] [--only throughput,probe_overhead,...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from benchmarks.ab import ROOT

SCRIPTS = (
    "throughput",
    "probe_overhead",
    "empty_path",
    "scaling",
    "lifecycle_cost",
    "sb3_overhead",
    "sb3_recurrent_overhead",
    "per_epoch_default",
    "probe_cadence",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-run every script")
    parser.add_argument(
        "--only", default=",".join(SCRIPTS), help=f"comma-separated subset of {SCRIPTS}"
    )
    args = parser.parse_args()
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(SCRIPTS)}")
    failed = []
    for name in chosen:
        print(f"== benchmarks.{name}", flush=True)
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
            failed.append(name)
    if failed:
        sys.exit(f"benchmarks failed: {failed}")


if __name__ == "__main__":
    main()
