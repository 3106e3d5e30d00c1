"""Overhead by probe and observation cadence, in Cockpit's format: each of the five probes
alone and all five together, observing every 1, 4, 16 or 64 training passes, on the
CartPole MLP actor-critic and the Atari NatureCNN actor-critic (CPU, one torch thread).

As Cockpit (Schneider et al., NeurIPS 2021) reports its instruments: the run time of a
training loop with the probes over the same loop without them, per configuration and
interval. One process times every configuration of one model on the same minibatch,
interleaved in a shuffled order: a pass is a PPO-style update, an epoch 16 passes ending
in ``ProbeSession.epoch_end`` (the bare loop's too), and the probes observe passes 0, k,
2k, ... (``probe_schedule="every_k:k"``). Timed as the thread's CPU time (one torch
thread: all of the loop's work; wall time would count other processes on a shared core).

    python -m benchmarks.probe_cadence [--repeats N] [--out PATH] [--quick] [--models mlp,cnn]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import policy_probes as pp
from benchmarks.ab import RESULTS, machine, write_json

PROBES = ("relu", "saturation", "fisher", "gradient_flow", "relu_gradient_flow")
CADENCES = (1, 4, 16, 64)
PASSES_PER_EPOCH = 16
#: Cockpit's published factors (economy configuration), from its experiments repository
COCKPIT = {
    "CPU MLP": {1: 63.0, 64: 2.06},
    "GPU CNN (CIFAR-10 3C3D)": {1: 1.51, 4: 1.17, 16: 1.04, 64: 1.02},
}


def builders(names: tuple[str, ...]) -> list[tuple[Any, bool]]:
    """``(builder, backward)`` of each of the probes ``names``."""
    make = {
        "relu": (pp.attach_relu_activation_hooks, False),
        "saturation": (partial(pp.attach_saturated_activation_hooks, "tanh"), False),
        "fisher": (pp.attach_fisher_information_hooks, True),
        "gradient_flow": (pp.attach_gradient_flow_hooks, True),
        "relu_gradient_flow": (pp.attach_relu_gradient_flow_hooks, True),
    }
    return [(make[n][0](), make[n][1]) for n in names]


def model(kind: str) -> tuple[Any, list[str], torch.Tensor, int]:
    """The policy, the components probed, one minibatch of observations and its rows."""
    from trainers import PolicyConfig
    from trainers.cnn_policy import CNNActorCriticPolicy
    from trainers.policy import ActorCriticPolicy

    torch.manual_seed(0)
    if kind == "mlp":
        space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        policy = ActorCriticPolicy(space, gym.spaces.Discrete(2), PolicyConfig(activation="relu"))
        return policy, ["actor_mlp", "critic_mlp"], torch.randn(128, 4), 128
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    policy = CNNActorCriticPolicy(space, gym.spaces.Discrete(4))
    obs = torch.randint(0, 256, (64, 4, 84, 84), dtype=torch.uint8)
    return policy, ["encoder"], obs, 64


def timed_run(kind: str, names: tuple[str, ...], every: int, passes: int) -> float:
    """Seconds of ``passes`` updates with the probes ``names`` observing every ``every``-th
    pass (no probe: ``names`` empty)."""
    from policy_probes import ProbeSettings
    from policy_probes.session import ProbeSession
    from policy_probes.sinks import SinksConfig, WandbConfig

    policy, components, obs, rows = model(kind)
    opt = torch.optim.Adam(policy.parameters(), lr=2.5e-4, eps=1e-5)
    g = torch.Generator().manual_seed(1)
    actions = torch.randint(0, 2 if kind == "mlp" else 4, (rows,), generator=g)
    old_logp = torch.full((rows,), -0.7)
    adv = torch.randn(rows, generator=g)
    returns = torch.randn(rows, generator=g)
    sinks = SinksConfig(console=False, csv=False, wandb=False)
    with tempfile.TemporaryDirectory() as run_dir:
        session = ProbeSession(
            policy,
            optimizer=opt,
            run=run_dir,
            probing=ProbeSettings(
                sinks=sinks,
                wandb=WandbConfig(mode="disabled"),
                probe_schedule=f"every_k:{every}",
                probe_budget=None,
            ),
        )
        with session:
            for component in components:
                for builder, backward in builders(names):
                    attach = (
                        session.add_training_backward_hook
                        if backward
                        else session.add_training_hook
                    )
                    attach(component, builder)
            start = time.thread_time()
            for i in range(passes):
                if i % PASSES_PER_EPOCH == 0:
                    session.set_phase("train")
                logp, entropy, value = policy.evaluate_actions(obs, actions)
                ratio = (logp - old_logp).exp()
                pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                loss = pg + 0.5 * (value.squeeze(-1) - returns).square().mean()
                loss = loss - 0.01 * entropy.mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if (i + 1) % PASSES_PER_EPOCH == 0:
                    session.epoch_end(step=i + 1)
            return time.thread_time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "probe_cadence.json")
    parser.add_argument("--quick", action="store_true", help="a smoke test, not a measurement")
    parser.add_argument("--models", default="mlp,cnn", help="mlp, cnn or both")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    passes = {"mlp": 16 if args.quick else 256, "cnn": 16 if args.quick else 64}
    passes = {k: v for k, v in passes.items() if k in args.models.split(",")}
    cadences = (1, 4) if args.quick else CADENCES
    sets = [(p,) for p in PROBES] + [PROBES]
    configs = [(k, names, every) for k in passes for names in sets for every in cadences]
    times: dict[tuple, list[float]] = {}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = configs + [(k, (), 1) for k in passes]
        rng.shuffle(order)
        for kind, names, every in order:
            times.setdefault((kind, names, every), []).append(
                timed_run(kind, names, every, passes[kind])
            )
    table: dict[str, dict[str, dict[str, float]]] = {}
    for kind, names, every in configs:
        bare = statistics.median(times[(kind, (), 1)])
        ratio = statistics.median(times[(kind, names, every)]) / bare
        label = "all five" if len(names) > 1 else names[0]
        table.setdefault(kind, {}).setdefault(label, {})[str(every)] = ratio
    for kind, rows in table.items():
        print(f"\n{kind}: time with probes / without, every k passes")
        print(f"{'probe':22s}" + "".join(f"{'k=' + str(c):>9s}" for c in cadences))
        for label, by_k in rows.items():
            print(f"{label:22s}" + "".join(f"{by_k[str(c)]:9.3f}" for c in cadences))
    write_json(
        args.out,
        {
            "title": "probe overhead by probe and cadence (Cockpit's format)",
            "machine": machine(),
            "repeats": args.repeats,
            "passes": passes,
            "bare_seconds": {k: statistics.median(times[(k, (), 1)]) for k in passes},
            "ratios": table,
            "cockpit": COCKPIT,
        },
    )


if __name__ == "__main__":
    main()
