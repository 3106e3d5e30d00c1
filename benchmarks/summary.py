"""Print the results under ``benchmarks/results/`` as the markdown tables of
``docs/benchmarks.md``: per comparison the median wall-time ratio, its range over the
A/B pairs, the median CPU-time ratio and the number of pairs.

    python -m benchmarks.summary [RESULTS_DIR]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.ab import RESULTS

FILES = (
    "throughput",
    "probe_overhead",
    "probe_overhead_atari",
    "scaling",
    "empty_path",
    "lifecycle_cost",
)


def table(payload: dict) -> list[str]:
    lines = [
        "| comparison | A | B | median A (s) | median B (s) | B/A wall (median) | range "
        "| B/A CPU (median) | pairs | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in payload["comparisons"]:
        r = c["ratios_b_over_a"]
        cpu = c.get("median_cpu_ratio_b_over_a")
        lines.append(
            f"| {c['name']} | {c['a']['label']} | {c['b']['label']} "
            f"| {c['median_seconds_a']:.2f} | {c['median_seconds_b']:.2f} "
            f"| **{c['median_ratio_b_over_a']:.3f}** | {min(r):.2f}-{max(r):.2f} "
            f"| {'-' if cpu is None else f'{cpu:.3f}'} | {len(r)} | {c['target']} |"
        )
    return lines


def extras(name: str, payload: dict) -> list[str]:
    out = []
    if name == "throughput":
        for c in payload["comparisons"]:
            sps = statistics.median(e["sps"] for e in c["extra_a"])
            sb3 = statistics.median(e["sps"] for e in c["extra_b"])
            out.append(f"- {c['name']}: ours {sps:.0f} SPS, SB3 {sb3:.0f} SPS (medians)")
    if name == "empty_path" and "callback_share" in payload:
        out.append(
            f"- share of the TrainTool run's wall time spent in trainer callbacks: "
            f"{100 * payload['callback_share']:.2f} % (median of "
            f"{len(payload['callback_shares'])} runs)"
        )
    if name == "scaling":
        for label, per_epoch in payload["tracker_bytes_per_epoch"].items():
            out.append(
                f"- tracker bytes after each epoch, {label}: min {min(per_epoch)}, "
                f"max {max(per_epoch)} ({len(per_epoch)} epochs)"
            )
    if name == "lifecycle_cost":
        for comp, cost in payload["cost_per_firing"].items():
            upe = cost["update_phase_equivalents"]
            upe_s = f"{upe:.2f}" if upe is not None else "-"
            out.append(
                f"- {comp}: {cost['firings']} firings, {upe_s} update-phase equivalents per firing"
            )
    return out


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    for name in FILES:
        path = root / f"{name}.json"
        if not path.exists():
            print(f"## {name}: no results ({path} missing)\n")
            continue
        payload = json.loads(path.read_text())
        m = payload["machine"]
        print(f"## {payload['title']}\n")
        print(f"{m['date']}, {m['cpus']} CPUs, {m['platform']}, torch {m['torch']}\n")
        print("\n".join(table(payload)))
        more = extras(name, payload)
        if more:
            print("\n" + "\n".join(more))
        print()


if __name__ == "__main__":
    main()
