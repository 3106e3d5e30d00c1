"""SB3 overhead: Stable-Baselines3 PPO with the ProbeCallback against SB3 without it.

Both sides train PPO on CartPole-v1 with the hyperparameters of the throughput benchmark
(4 envs x 128 steps, minibatches of 128, 4 update epochs, 64-64 actor and critic, CPU,
one torch thread). Side B adds ``ProbeCallback`` with all five module probes (relu,
saturation_tanh, fisher, gradient_flow, relu_gradient_flow) on ``actor_mlp`` and
``critic_mlp``, writing one JSONL record per rollout/update cycle (console, CSV and W&B
off: this measures the probes, not the sinks). The network uses ReLU so that every probe
has something to measure.

Measurements alternate A B A B (the first side swaps every repeat), each in a fresh
interpreter; the figure is the median over repeats of the paired ratio B/A of wall time
of ``PPO(...)`` + ``learn()``.

    python benchmarks/sb3_overhead.py                 # 5 repeats of 32768 steps
    python benchmarks/sb3_overhead.py --quick --out /tmp/sb3.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sb3_overhead.json"
HYPERPARAMETERS: dict[str, Any] = {
    "env_id": "CartPole-v1",
    "num_envs": 4,
    "n_steps": 128,
    "batch_size": 128,
    "n_epochs": 4,
    "hidden": [64, 64],
    "activation": "relu",
    "learning_rate": 2.5e-4,
    "seed": 1,
    "torch_threads": 1,
}
SIDES = {"A": "sb3", "B": "sb3+ProbeCallback(5 probes x 2 components)"}


# ---------------------------------------------------------------------------- worker
def worker(side: str, steps: int) -> dict[str, Any]:
    """One timed run in this process; returns seconds, steps and records."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from torch import nn

    torch.set_num_threads(HYPERPARAMETERS["torch_threads"])
    hp = HYPERPARAMETERS
    callback = None
    run_dir = tempfile.mkdtemp(prefix="sb3-overhead-")
    if side == "B":
        from policy_probes import (
            attach_fisher_information_hooks,
            attach_gradient_flow_hooks,
            attach_relu_activation_hooks,
            attach_relu_gradient_flow_hooks,
            attach_saturated_activation_hooks,
        )
        from policy_probes.integrations.sb3 import ProbeCallback
        from policy_probes.sinks import SinksConfig, WandbConfig

        forward, backward = [], []
        for component in ("actor_mlp", "critic_mlp"):
            forward += [
                (component, attach_relu_activation_hooks()),
                (component, attach_saturated_activation_hooks("tanh")),
            ]
            backward += [
                (component, attach_fisher_information_hooks()),
                (component, attach_gradient_flow_hooks()),
                (component, attach_relu_gradient_flow_hooks()),
            ]
        callback = ProbeCallback(
            probes=forward,
            backward_probes=backward,
            run_dir=run_dir,
            sinks=SinksConfig(console=False, csv=False, wandb=False),
            wandb=WandbConfig(mode="disabled"),
        )
    activation = nn.ReLU if hp["activation"] == "relu" else nn.Tanh
    t0 = time.perf_counter()
    env = make_vec_env(hp["env_id"], n_envs=hp["num_envs"], seed=hp["seed"])
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=hp["n_steps"],
        batch_size=hp["batch_size"],
        n_epochs=hp["n_epochs"],
        learning_rate=hp["learning_rate"],
        policy_kwargs={
            "net_arch": {"pi": hp["hidden"], "vf": hp["hidden"]},
            "activation_fn": activation,
        },
        device="cpu",
        seed=hp["seed"],
    )
    model.learn(total_timesteps=steps, callback=callback)
    seconds = time.perf_counter() - t0
    env.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    out: dict[str, Any] = {"seconds": seconds, "steps": int(model.num_timesteps)}
    out["sps"] = out["steps"] / seconds
    if callback is not None:
        out["records"] = len(callback.history)
        last = callback.history[-1] if callback.history else {}
        out["probe_keys"] = sum(1 for k in last if k.startswith("probes/"))
    return out


def run_side(side: str, steps: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--steps", str(steps)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"side {side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ main
def machine() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def benchmark(steps: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for r in range(repeats):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for side in order:
            runs[side].append(run_side(side, steps))
        a, b = runs["A"][-1]["seconds"], runs["B"][-1]["seconds"]
        print(f"[{r + 1}/{repeats}] sb3 {a:.2f}s  sb3+probes {b:.2f}s  ratio {b / a:.3f}")
    seconds = {s: [x["seconds"] for x in runs[s]] for s in runs}
    ratios = [b / a for a, b in zip(seconds["A"], seconds["B"], strict=True)]
    return {
        "benchmark": "sb3_overhead",
        "description": "SB3 PPO CartPole-v1 with ProbeCallback (B) vs without (A), wall time",
        "sides": SIDES,
        "hyperparameters": HYPERPARAMETERS,
        "total_timesteps": steps,
        "repeats": repeats,
        "machine": machine(),
        "seconds": seconds,
        "median_seconds": {s: statistics.median(v) for s, v in seconds.items()},
        "sps_median": {s: statistics.median(x["sps"] for x in runs[s]) for s in runs},
        "ratios_b_over_a": ratios,
        "median_ratio": statistics.median(ratios),
        "records_per_run": runs["B"][-1].get("records"),
        "probe_keys_per_record": runs["B"][-1].get("probe_keys"),
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"SB3 PPO overhead of ProbeCallback ({result['total_timesteps']} steps)")
    for col in ("side", "median s", "median SPS", "median B/A", "repeats"):
        table.add_column(col)
    for side, label in SIDES.items():
        ratio = f"{result['median_ratio']:.3f}" if side == "B" else ""
        table.add_row(
            label,
            f"{result['median_seconds'][side]:.2f}",
            f"{result['sps_median'][side]:.0f}",
            ratio,
            str(result["repeats"]),
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32_768, help="total_timesteps per run")
    parser.add_argument("--repeats", type=int, default=5, help="A/B pairs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1024 steps, 1 pair")
    parser.add_argument("--worker", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps)), flush=True)
        return
    steps, repeats = (1024, 1) if args.quick else (args.steps, args.repeats)
    result = benchmark(steps, repeats)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
