"""Timed cases for the A/B benchmarks; each prints one JSON line.

    python -m benchmarks.cases ours '{"total_timesteps": 20480, "probes": true}'

Cases:
* ``ours``: the built-in PPO trainer through :class:`trainers.TrainTool` (sinks, evaluation
  and checkpoints off unless asked), optionally with all five module probes on
  ``actor_mlp`` and ``critic_mlp`` and/or W&B's own ``wandb.watch(log="all", log_freq=1)``.
* ``sb3``: Stable-Baselines3 PPO with the same hyperparameters.

The timed region is building the run and training it (``invoke()`` / ``PPO(...)`` +
``learn()``); interpreter start and imports are outside it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

DEFAULTS: dict[str, Any] = {
    "env_id": "CartPole-v1",
    "total_timesteps": 20_480,
    "num_envs": 4,
    "num_steps": 128,
    "num_minibatches": 4,
    "update_epochs": 4,
    "hidden": 64,
    "activation": "tanh",
    "vectorization": "sync",
    "probes": False,
    "jsonl": False,
    "wandb_watch": False,
    "seed": 1,
}


def probe_builders() -> list[tuple[str, Any, bool]]:
    from policy_probes import (
        attach_fisher_information_hooks,
        attach_gradient_flow_hooks,
        attach_relu_activation_hooks,
        attach_relu_gradient_flow_hooks,
        attach_saturated_activation_hooks,
    )

    out = []
    for component in ("actor_mlp", "critic_mlp"):
        out += [
            (component, attach_relu_activation_hooks(), False),
            (component, attach_saturated_activation_hooks("tanh"), False),
            (component, attach_fisher_information_hooks(), True),
            (component, attach_gradient_flow_hooks(), True),
            (component, attach_relu_gradient_flow_hooks(), True),
        ]
    return out


def ours(p: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    from policy_probes.sinks import SinksConfig, WandbConfig
    from trainers import (
        CheckpointConfig,
        EnvConfig,
        EvalConfig,
        PolicyConfig,
        PPOConfig,
        TrainerHook,
        TrainTool,
    )

    run_dir = tempfile.mkdtemp(prefix="pp-bench-")
    tool = TrainTool(
        env=EnvConfig(id=p["env_id"], num_envs=p["num_envs"], vectorization=p["vectorization"]),
        policy=PolicyConfig(hidden_sizes=[p["hidden"], p["hidden"]], activation=p["activation"]),
        trainer=PPOConfig(
            total_timesteps=p["total_timesteps"],
            num_steps=p["num_steps"],
            num_minibatches=p["num_minibatches"],
            update_epochs=p["update_epochs"],
        ),
        evaluation=EvalConfig(every_epochs=0, at_end=False),
        checkpoint=CheckpointConfig(every_epochs=0, at_end=False),
        sinks=SinksConfig(
            console=False, jsonl=p["jsonl"], csv=False, wandb=False, tensorboard=False
        ),
        wandb=WandbConfig(mode="disabled"),
        seed=p["seed"],
        run_dir=run_dir,
        torch_threads=1,
    )
    if p["probes"]:
        for component, builder, backward in probe_builders():
            if backward:
                tool.add_training_backward_hook(component, builder)
            else:
                tool.add_training_hook(component, builder)
    memory: list[int] = []

    class TrackerMemory(TrainerHook):
        """Device bytes held by the probe trackers after each epoch's collection."""

        def on_epoch_end(self, state: Any) -> None:
            memory.append(sum(t.nbytes() for t in state.context.model_metrics.values()))

    tool.add_trainer_hook(TrackerMemory())
    run = None
    if p["wandb_watch"]:
        import wandb

        run = wandb.init(mode="offline", dir=run_dir, project="policy-probes-bench")

        class Watch(TrainerHook):
            def on_new_training_run(self, state: Any) -> None:
                wandb.watch(state.policy, log="all", log_freq=1)

        tool.add_trainer_hook(Watch())
    t0 = time.perf_counter()
    result = tool.invoke()
    seconds = time.perf_counter() - t0
    if run is not None:
        run.finish()
    return {
        "seconds": seconds,
        "steps": result.agent_step,
        "sps": result.agent_step / seconds,
        "tracker_bytes_per_epoch": memory,
    }


def sb3(p: dict[str, Any]) -> dict[str, Any]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from torch import nn

    lr = 2.5e-4
    t0 = time.perf_counter()
    env = make_vec_env(p["env_id"], n_envs=p["num_envs"], seed=p["seed"])
    batch = p["num_envs"] * p["num_steps"]
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=p["num_steps"],
        batch_size=batch // p["num_minibatches"],
        n_epochs=p["update_epochs"],
        learning_rate=lambda progress: lr * progress,  # linear annealing, as ours
        gamma=0.99,
        gae_lambda=0.95,
        clip_range=0.2,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        policy_kwargs={
            "net_arch": {"pi": [p["hidden"]] * 2, "vf": [p["hidden"]] * 2},
            "activation_fn": nn.ReLU if p["activation"] == "relu" else nn.Tanh,
        },
        device="cpu",
        seed=p["seed"],
        verbose=0,
    )
    model.learn(total_timesteps=p["total_timesteps"])
    seconds = time.perf_counter() - t0
    env.close()
    return {"seconds": seconds, "steps": model.num_timesteps, "sps": model.num_timesteps / seconds}


CASES = {"ours": ours, "sb3": sb3}


def main() -> None:
    torch.set_num_threads(1)
    case = sys.argv[1]
    params = dict(DEFAULTS)
    params.update(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    print(json.dumps(CASES[case](params)), flush=True)


if __name__ == "__main__":
    main()
