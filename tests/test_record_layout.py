"""One record layout for every driver: the built-in trainer, the Stable-Baselines3
callback and a CleanRL-style loop, given the same probes and lifecycle hooks, write the
same hook points in the same order and the same probe and lifecycle keys.

The probe goes on the ReLU output that all three policies name ``actor_mlp`` and the
lifecycle hook reports no per-layer keys. The CleanRL-style loop trains the trainer's
own policy class, so its probe keys equal the trainer's, per-layer keys included; SB3's
``MlpPolicy`` is another network (its layers are named ``actor_mlp.1``, not
``actor_mlp.layer_0``), so with it the component-level keys are compared.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import sb3_cartpole
from torch import nn

from policy_probes import ProbeSettings, Run, attach_relu_activation_hooks
from policy_probes.integrations.sb3 import ProbeCallback
from policy_probes.records import read_jsonl
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig
from trainers import PolicyConfig, TrainTool, make_policy

torch.set_num_threads(1)

EPOCHS, SNAPSHOT_EVERY = 3, 2
HOOKS = {"hooks": ["adam_dynamics"], "hook_config": {"adam_dynamics.per_layer": False}}
SINKS = SinksConfig(console=False, csv=False, wandb=False)
NO_WANDB = WandbConfig(mode="disabled")
#: every pass observed: each epoch carries every probe key in all three drivers
EVERY_PASS = {"probe_budget": None}
#: the same settings as one model (ProbeCallback, ProbeSession); TrainTool has them as fields
PROBING = ProbeSettings(
    sinks=SINKS, wandb=NO_WANDB, snapshot_every=SNAPSHOT_EVERY, **HOOKS, **EVERY_PASS
)


def trainer_records(run_dir: Path) -> list[dict]:
    tool = TrainTool(
        run_dir=run_dir,
        env={"num_envs": 2},
        policy={"hidden_sizes": [16], "activation": "relu"},
        trainer={
            "total_timesteps": EPOCHS * 2 * 16,
            "num_steps": 16,
            "num_minibatches": 2,
            "update_epochs": 1,
        },
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 0, "at_end": False},
        sinks=SINKS,
        wandb=NO_WANDB,
        snapshot_every=SNAPSHOT_EVERY,
        torch_threads=1,
        **HOOKS,
        **EVERY_PASS,
    )
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    tool.invoke()
    return read_jsonl(run_dir / "metrics.jsonl")


def sb3_records(run_dir: Path) -> list[dict]:
    model = sb3_cartpole(activation_fn=nn.ReLU)
    callback = ProbeCallback(
        probes=[("actor_mlp", attach_relu_activation_hooks())],
        run_dir=run_dir,
        probing=PROBING,
    )
    model.learn(EPOCHS * 2 * 16, callback=callback)
    return read_jsonl(run_dir / "metrics.jsonl")


def cleanrl_records(run_dir: Path) -> list[dict]:
    import gymnasium as gym

    torch.manual_seed(0)
    env = gym.make("CartPole-v1")
    config = PolicyConfig(hidden_sizes=[16], activation="relu")
    agent = make_policy(env.observation_space, env.action_space, config)
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    with ProbeSession(agent, run=Run(run_dir), probing=PROBING, optimizer=optimizer) as session:
        session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        for epoch in range(EPOCHS):
            with session.phase("rollout"), torch.no_grad():
                obs = torch.randn(32, 4)
                actions, _, _ = agent.act(obs)
            session.rollout_end(observations=obs)  # the reference states (relu's _ref keys)
            with session.phase("train"):
                for mb_obs, mb_actions in zip(obs.split(16), actions.split(16), strict=True):
                    logprob, entropy, value = agent.evaluate_actions(mb_obs, mb_actions)
                    loss = -(logprob + 0.01 * entropy).mean() + value.square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    session.pre_step(loss=loss)
                    optimizer.step()
                    session.post_step()
            session.log({"train/loss": loss})
            session.epoch_end(step=(epoch + 1) * 32)
    return read_jsonl(run_dir / "metrics.jsonl")


def layout(records: list[dict]) -> tuple[list[str], list[frozenset[str]], list[frozenset[str]]]:
    """Hook points in order, and per record the probe keys and the lifecycle keys."""
    points = [r["hook_point"] for r in records]
    probes = [frozenset(k for k in r if k.startswith("probes/")) for r in records]
    hooks = [frozenset(k for k in r if k.startswith("adam_dynamics/")) for r in records]
    return points, probes, hooks


def component_level(keys: frozenset[str]) -> frozenset[str]:
    return frozenset(k for k in keys if k.startswith("probes/relu/actor_mlp/"))


def test_trainer_sb3_and_cleanrl_loop_write_the_same_layout(tmp_path):
    trainer = layout(trainer_records(tmp_path / "trainer"))
    sb3 = layout(sb3_records(tmp_path / "sb3"))
    cleanrl = layout(cleanrl_records(tmp_path / "cleanrl"))

    # POST_EPOCH every epoch, then SNAPSHOT in every second epoch
    expected_points = ["POST_EPOCH", "POST_EPOCH", "SNAPSHOT", "POST_EPOCH"]
    assert trainer[0] == sb3[0] == cleanrl[0] == expected_points
    main = [i for i, p in enumerate(expected_points) if p == "POST_EPOCH"]
    relu = {
        f"probes/relu/actor_mlp/{m}"
        for m in ("samples", "dead_fraction", "zero_fraction", "active_rate")
    }
    for i in main:
        assert trainer[1][i] == cleanrl[1][i]
        assert any(".layer_0/" in k for k in trainer[1][i])  # per-layer keys of that policy
        assert any(".1/" in k for k in sb3[1][i])  # and those of SB3's
        ours = component_level(trainer[1][i])
        assert ours == component_level(sb3[1][i]) == component_level(cleanrl[1][i])
        assert relu <= ours
        assert trainer[2][i] == sb3[2][i] == cleanrl[2][i]
        assert {"adam_dynamics/update_ratio", "adam_dynamics/optimizer_step"} <= trainer[2][i]
    for i in set(range(len(expected_points))) - set(main):
        assert trainer[1][i] == sb3[1][i] == cleanrl[1][i] == frozenset()
