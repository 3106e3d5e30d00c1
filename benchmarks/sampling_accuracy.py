"""The accuracy side of sampling: how far a sampled epoch metric is from the every-pass
value over a run.

The same seeded run of the built-in trainer (CartPole, 64-64 ReLU policy, the five module
probes on ``actor_mlp`` and ``critic_mlp``; sinks JSONL only) is trained once per
sampling setting. Probes never change training, so every run follows the same trajectory
(checked: ``train/*`` values equal), and each epoch's sampled metric can be compared with
the every-pass value of the same epoch. Reported per setting and metric, over the epochs
in which the sampled run reported it: the median and 90th percentile of the absolute
error (fractions and rates) or of the relative error (Fisher trace, gradient RMS), the
share of epochs reported, and the median rows observed.

    python -m benchmarks.sampling_accuracy [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
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
    from benchmarks.cases import probe_builders
    from policy_probes.records import iter_jsonl
    from policy_probes.sinks import SinksConfig, WandbConfig
    from trainers import (
        CheckpointConfig,
        EnvConfig,
        EvalConfig,
        PolicyConfig,
        PPOConfig,
        TrainTool,
    )

    tool = TrainTool(
        env=EnvConfig(num_envs=4, vectorization="sync"),
        policy=PolicyConfig(hidden_sizes=[64, 64], activation="relu"),
        trainer=PPOConfig(total_timesteps=steps, num_steps=128, num_minibatches=4, update_epochs=4),
        evaluation=EvalConfig(every_epochs=0, at_end=False),
        checkpoint=CheckpointConfig(every_epochs=0, at_end=False),
        sinks=SinksConfig(console=False, jsonl=True, csv=False, wandb=False, tensorboard=False),
        wandb=WandbConfig(mode="disabled"),
        run_dir=tempfile.mkdtemp(prefix="pp-accuracy-"),
        torch_threads=1,
        seed=1,
        **settings,
    )
    for component, builder, placement in probe_builders():
        tool.add_training_hook(component, builder, **placement)
    result = tool.invoke()
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
    rows = [
        s["probes/relu/actor_mlp/rows_observed"]
        for s in sampled
        if "probes/relu/actor_mlp/rows_observed" in s
    ]
    out["median_rows_observed_relu_actor"] = statistics.median(rows) if rows else 0
    se = [
        s["probes/relu/actor_mlp/active_rate_se"]
        for s in sampled
        if "probes/relu/actor_mlp/active_rate_se" in s
    ]
    out["median_active_rate_se"] = statistics.median(se) if se else None
    fractions = [s["probes/overhead_fraction"] for s in sampled if "probes/overhead_fraction" in s]
    out["median_overhead_fraction"] = statistics.median(fractions) if fractions else None
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
        "median_rows_observed_relu_actor": statistics.median(
            r["probes/relu/actor_mlp/rows_observed"] for r in exact
        ),
        "median_overhead_fraction": statistics.median(r["probes/overhead_fraction"] for r in exact),
    }
    for name, rep in report.items():
        print(name, json.dumps(rep, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"steps": steps, "settings": SETTINGS, "report": report}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
