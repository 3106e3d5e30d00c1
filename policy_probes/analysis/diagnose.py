"""``policy-probes diagnose RUN_DIR [--json]``: the findings of a run (finished or still
training), from its ``metrics.jsonl`` (:mod:`policy_probes.analysis.findings`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from policy_probes.analysis.findings import WINDOW, diagnose_run, render_text, to_json


def add_diagnose_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """``policy-probes diagnose RUN_DIR [--json] [--window N]``."""
    p = subparsers.add_parser(
        "diagnose",
        help="what is going wrong in a run: findings with evidence and remedies",
        description="Read RUN_DIR/metrics.jsonl (also while the run is training) and print "
        "the findings of the plasticity rules: which measure crossed which threshold as a "
        "trend, for which component or layer, since which epoch, and what to do about it.",
    )
    p.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"epochs of the rolling median and of the baseline (default {WINDOW})",
    )
    p.set_defaults(handler=diagnose_command)


def diagnose_command(args: argparse.Namespace) -> int:
    """Handler of ``diagnose``: 0 (findings or none), 2 when RUN_DIR has no metrics."""
    if args.window < 1:
        print("policy-probes diagnose: error: --window must be >= 1", file=sys.stderr)
        return 2
    try:
        findings = diagnose_run(args.run_dir, window=args.window)
    except FileNotFoundError as exc:
        print(f"policy-probes diagnose: error: {exc}", file=sys.stderr)
        return 2
    print(to_json(findings) if args.json else render_text(findings))
    return 0
