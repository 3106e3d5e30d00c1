"""The accuracy side of sampling: how far a sampled epoch metric is from the every-pass
value over a run.

The same seeded run (:func:`benchmarks.cases.train_tool`: CartPole, ReLU policy, the five
module probes, JSONL only) is trained once per sampling setting. Probes never change
training (checked: ``train/*`` values equal), so each epoch's sampled metric is compared
with the every-pass value of the same epoch: per setting and metric, the median and 90th
percentile of the absolute or relative error (:data:`METRICS`), the share of epochs
reported, and the median rows observed.

    python -m benchmarks.sampling_accuracy [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.ab import RESULTS, write_json

ROWS = "probes/relu/actor_mlp/rows_observed"
SETTINGS = {
    "every": {"probe_budget": None, "probe_schedule": "every"},
    "default (one pass in 16 per epoch)": {"probe_budget": 0.05},
    "per_epoch:2": {"probe_budget": None, "probe_schedule": "per_epoch:2"},
    "probe_batch:256": {"probe_budget": 0.05, "probe_schedule": "probe_batch:256"},
}
#: metric -> "abs" (absolute error) or "rel" (relative error)
METRICS = {
    "probes/relu/actor_mlp/dead_fraction": "abs",
    "probes/relu/actor_mlp/dormant_fraction": "abs",
    "probes/relu/actor_mlp/zero_fraction": "abs",
    "probes/relu/critic_mlp/zero_fraction": "abs",
    "probes/relu/actor_mlp/active_rate": "abs",  # mean over units of |difference|
    "probes/saturation_tanh/critic_mlp/saturated_fraction": "abs",
    "probes/fisher/actor_mlp/trace": "rel",
    "probes/fisher/critic_mlp/trace": "rel",
    "probes/gradient_flow/actor_mlp/mean": "rel",
    "probes/relu_gradient_flow/actor_mlp/blocked_fraction": "abs",
}


def run(settings: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """The POST_EPOCH records of the run with the sampling ``settings``."""
    from benchmarks.cases import DEFAULTS, train_tool
    from policy_probes.records import iter_jsonl

    p = dict(DEFAULTS, activation="relu", probes=True, jsonl=True, total_timesteps=steps)
    result = train_tool({**p, **settings}, prefix="pp-accuracy-").invoke()
    records = iter_jsonl(result.run_dir / "metrics.jsonl")
    return [r for r in records if r.get("hook_point") == "POST_EPOCH"]


def error(kind: str, sampled: Any, exact: Any) -> float:
    if isinstance(exact, list):
        return statistics.mean(abs(a - b) for a, b in zip(sampled, exact, strict=True))
    if kind == "rel":
        return abs(sampled - exact) / abs(exact) if exact else abs(sampled)
    return abs(sampled - exact)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def median_of(records: list[dict], key: str, missing: Any = None) -> Any:
    """The median of ``key`` over the records that have it (``missing`` when none does)."""
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else missing


def compare(exact: list[dict], sampled: list[dict]) -> dict[str, Any]:
    same = all(
        a.get(k) == b.get(k)
        for a, b in zip(exact, sampled, strict=True)
        for k in a
        if k.startswith("train/")
    )
    out: dict[str, Any] = {"same_trajectory": same, "metrics": {}}
    for key, kind in METRICS.items():
        errors = [
            error(kind, s[key], e[key])
            for e, s in zip(exact, sampled, strict=True)
            if key in s and key in e
        ]
        if not errors:
            continue
        out["metrics"][key] = {
            "kind": kind,
            "median_error": statistics.median(errors),
            "p90_error": quantile(errors, 0.9),
            "epochs_reported": len(errors) / len(exact),
        }
    out["median_rows_observed_relu_actor"] = median_of(sampled, ROWS, 0)
    out["median_active_rate_se"] = median_of(sampled, "probes/relu/actor_mlp/active_rate_se")
    out["median_overhead_fraction"] = median_of(sampled, "probes/overhead_fraction")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 epochs (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sampling_accuracy.json")
    args = parser.parse_args(argv)
    steps = 2048 if args.quick else 20_480
    records = {name: run(settings, steps) for name, settings in SETTINGS.items()}
    exact = records["every"]
    report = {name: compare(exact, recs) for name, recs in records.items() if name != "every"}
    report["every"] = {
        "median_rows_observed_relu_actor": statistics.median(r[ROWS] for r in exact),
        "median_overhead_fraction": statistics.median(r["probes/overhead_fraction"] for r in exact),
    }
    for name, rep in report.items():
        print(name, json.dumps(rep, indent=1))
    write_json(args.out, {"steps": steps, "settings": SETTINGS, "report": report}, indent=1)


if __name__ == "__main__":
    main()
