"""A short run of every recipe, checking the probes each one attaches report real values."""

from __future__ import annotations

import json

import pytest
import torch

from recipes import cartpole, cartpole_tanh, pendulum
from trainers import TrainTool

torch.set_num_threads(1)


def short(tool: TrainTool, tmp_path, **trainer) -> TrainTool:
    tool.run_dir = tmp_path / "run"
    tool.trainer = tool.trainer.model_copy(update=trainer)
    tool.wandb.mode = "disabled"
    tool.probe_budget = None  # every pass: sample counts are compared
    tool.sinks.console = False
    tool.evaluation = tool.evaluation.model_copy(
        update={"every_epochs": 0, "episodes": 2, "num_envs": 2}
    )
    return tool


def test_cartpole_recipe_defaults_and_its_four_relu_network_probes(tmp_path):
    tool = cartpole.train()
    assert isinstance(tool, TrainTool)
    t = tool.trainer
    assert (tool.env.num_envs, t.num_steps, t.num_minibatches, t.update_epochs) == (4, 128, 4, 4)
    assert (t.learning_rate, t.anneal_lr, t.gamma, t.gae_lambda, t.clip_coef) == (
        2.5e-4,
        True,
        0.99,
        0.95,
        0.2,
    )
    assert (t.ent_coef, t.vf_coef, t.total_timesteps) == (0.01, 0.5, 200_000)
    assert tool.policy.hidden_sizes == [64, 64] and tool.policy.activation == "relu"
    result = short(tool, tmp_path, total_timesteps=1024).invoke()
    m = result.metrics
    for comp in ("actor_mlp", "critic_mlp"):
        for key in (
            f"probes/relu/{comp}/dead_fraction",
            f"probes/fisher/{comp}/trace",
            f"probes/gradient_flow/{comp}/mean",
            f"probes/relu_gradient_flow/{comp}/blocked_fraction",
        ):
            assert key in m, key
        # saturation is the tanh recipe's: no saturation_tanh keys for a ReLU network
        assert not any(k.startswith("probes/saturation") for k in m)
        assert len(m[f"probes/relu/{comp}/active_rate"]) == 64
        assert 0.0 <= m[f"probes/relu/{comp}/dead_fraction"] <= 1.0
        assert m[f"probes/fisher/{comp}/trace"] > 0.0
        # samples seen in the train phase: update_epochs * batch (valid transitions only)
        batch = m["train/batch_size"]
        assert m[f"probes/relu/{comp}/samples"] == 4 * batch
    # the dead fraction reported is the fraction of units whose active rate is zero
    rates = m["probes/relu/actor_mlp/active_rate"]
    assert m["probes/relu/actor_mlp/dead_fraction"] == pytest.approx(
        sum(r == 0 for r in rates) / 64
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["agent_step"] == 1024


def test_cartpole_tanh_recipe_reports_saturation_per_layer(tmp_path):
    tool = cartpole_tanh.train()
    assert tool.policy.activation == "tanh"
    m = short(tool, tmp_path, total_timesteps=512).invoke().metrics
    for layer in (
        "actor_mlp.layer_0",
        "actor_mlp.layer_1",
        "critic_mlp.layer_0",
        "critic_mlp.layer_1",
    ):
        frac = m[f"probes/saturation_tanh/{layer}/saturated_fraction"]
        assert 0.0 <= frac <= 1.0
        assert 0.0 < m[f"probes/saturation_tanh/{layer}/mean_derivative"] <= 1.0
    assert "probes/gradient_flow/actor_mlp.layer_0/mean" in m


def test_pendulum_recipe_runs_continuous(tmp_path):
    tool = pendulum.train()
    assert tool.env.id == "Pendulum-v1" and tool.trainer.total_timesteps == 1_000_000
    result = short(
        tool, tmp_path, total_timesteps=2048, num_minibatches=4, update_epochs=1
    ).invoke()
    assert not result.policy.discrete and result.policy.log_std.shape == (1,)
    m = result.metrics
    assert m["probes/fisher/actor_mlp/trace"] > 0.0
    assert "probes/saturation_tanh/actor_mlp/saturated_fraction" in m
    assert m["rollout/episode_length"] == 200.0  # Pendulum always truncates at 200 steps
