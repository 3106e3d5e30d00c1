"""TrainTool: validation, builders, attach/detach lifecycle, outputs, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from policy_probes.lifecycle.rng import capture_rng_state, restore_rng_state
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.torch_internals import module_hook_count
from trainers import TrainerHook, TrainTool
from trainers.checkpoint import load_checkpoint, rng_state_from_plain, rng_state_to_plain

torch.set_num_threads(1)


def tiny_tool(tmp_path, epochs=2, **kw) -> TrainTool:
    return TrainTool(
        run_dir=tmp_path / "run",
        probe_budget=None,  # every pass: exact values are compared
        env={"num_envs": 2},
        policy={"activation": "relu", "hidden_sizes": [16, 16]},
        trainer={
            "total_timesteps": 2 * 16 * epochs,
            "num_steps": 16,
            "num_minibatches": 2,
            "update_epochs": 1,
        },
        evaluation={"every_epochs": 0, "at_end": False},
        sinks={"console": False, "csv": False, "wandb": False},
        **kw,
    )


def hooks_on(policy: torch.nn.Module) -> int:
    return module_hook_count(policy)


def test_validation_errors_are_clear():
    with pytest.raises(ValidationError, match="larger than the rollout batch"):
        TrainTool(env={"num_envs": 2}, trainer={"num_steps": 4, "num_minibatches": 16})
    with pytest.raises(ValidationError, match="greater than 0"):
        TrainTool(trainer={"num_steps": 0})
    with pytest.raises(ValidationError, match="CartPole-v1"):
        TrainTool(env={"id": "CartPol-v1"})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TrainTool(trainr={})
    with pytest.raises(ValidationError, match="smaller than one rollout"):
        TrainTool(trainer={"total_timesteps": 10})
    with pytest.raises(ValidationError, match="micro-batches"):
        TrainTool(
            env={"num_envs": 1}, trainer={"num_steps": 8, "num_minibatches": 2, "micro_batches": 3}
        )
    with pytest.raises(ValidationError, match="unknown activation 'rleu'.*'relu'"):
        TrainTool(policy={"activation": "rleu"})


def test_builders_chain_and_duplicates():
    tool = TrainTool()
    relu = attach_relu_activation_hooks()
    assert tool.add_training_hook("actor_mlp", relu) is tool
    assert tool.add_training_hook("critic_mlp", relu) is tool  # same builder, other pattern: fine
    with pytest.raises(ValueError, match="already attached"):
        tool.add_training_hook("actor_mlp", relu)
    with pytest.raises(TypeError, match="parentheses"):
        tool.add_training_hook("actor_mlp", None)
    fisher = attach_fisher_information_hooks()
    assert tool.add_training_backward_hook("actor_mlp", fisher) is tool
    assert [(p, b is relu or b is fisher, bw) for p, b, bw, _ in tool.hook_builders] == [
        ("actor_mlp", True, None),  # placed by the probe's own direction
        ("critic_mlp", True, None),
        ("actor_mlp", True, True),
    ]
    # builders survive model_copy (private attributes)
    assert len(tool.model_copy(update={"seed": 5}).hook_builders) == 3


def test_hooks_attached_during_training_and_removed_after(tmp_path):
    seen = {}

    class Count(TrainerHook):
        def on_mb_end(self, s):
            seen["during"] = hooks_on(s.policy)

    tool = tiny_tool(tmp_path)
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    tool.add_training_backward_hook("critic_mlp.*", attach_fisher_information_hooks())
    tool.add_trainer_hook(Count())
    result = tool.invoke()
    assert seen["during"] > 0
    assert hooks_on(result.policy) == 0
    assert result.policy.hook_handles == []
    assert "probes/relu/actor_mlp/dead_fraction" in result.metrics
    assert "probes/fisher/critic_mlp.layer_1/trace" in result.metrics


def test_hooks_removed_after_an_exception(tmp_path):
    captured = {}

    class Fail(TrainerHook):
        critical = True

        def on_mb_end(self, s):
            captured["policy"] = s.policy
            captured["during"] = hooks_on(s.policy)
            raise KeyboardInterrupt  # like Ctrl-C in the middle of an update

    tool = tiny_tool(tmp_path)
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    tool.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    tool.add_trainer_hook(Fail())
    with pytest.raises(KeyboardInterrupt):
        tool.invoke()
    assert captured["during"] > 0
    assert hooks_on(captured["policy"]) == 0


def test_unknown_component_fails_before_training(tmp_path):
    started = []

    class Start(TrainerHook):
        def on_new_training_run(self, s):
            started.append(True)

    tool = tiny_tool(tmp_path).add_training_hook("actor_mpl", attach_relu_activation_hooks())
    tool.add_trainer_hook(Start())
    with pytest.raises(KeyError, match="actor_mlp") as exc:
        tool.invoke()
    assert "Available components" in str(exc.value)
    assert started == []
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_outputs_config_metrics_and_checkpoints(tmp_path):
    tool = tiny_tool(tmp_path, epochs=3, checkpoint={"every_epochs": 1, "keep_last": 2}, seed=7)
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    tool.record_launch("recipes.cartpole.train", ["seed=7"])
    result = tool.invoke()
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["train_tool"]["seed"] == 7 and config["recipe"] == "recipes.cartpole.train"
    assert config["overrides"] == ["seed=7"]
    assert TrainTool.model_validate(config["train_tool"]).trainer.num_steps == 16  # rebuildable
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2, 3]
    assert [r["agent_step"] for r in lines] == [32, 64, 96]
    assert all(isinstance(r["probes/relu/actor_mlp/active_rate"], list) for r in lines)
    assert lines[-1]["train/policy_loss"] == pytest.approx(result.metrics["train/policy_loss"])

    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["epoch_000002.pt", "epoch_000003.pt"]  # keep_last=2, no temp files left
    ck = load_checkpoint(run / "checkpoints" / "epoch_000003.pt")  # weights_only=True
    assert ck["epoch"] == 3 and ck["agent_step"] == 96 and ck["seed"] == 7
    for k, v in result.policy.state_dict().items():
        assert torch.equal(ck["policy"][k], v)
    assert ck["optimizer"]["state"] and ck["scheduler"]["last_epoch"] == 3
    assert set(ck["rng"]) >= {"torch", "numpy", "python"}
    assert set(ck["trainer_rng"]) == {"sample", "shuffle"}
    assert result.last_checkpoint == run / "checkpoints" / "epoch_000003.pt"


def test_rng_state_roundtrip():
    import random

    import numpy as np

    saved = rng_state_to_plain(capture_rng_state())  # as a checkpoint stores it
    a = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(rng_state_from_plain(saved))
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and a[2] == b[2]


def test_default_run_dir_uses_name_and_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tool = TrainTool(name="cartpole", seed=4)
    path = tool.default_run_dir()
    assert path.parts[0] == "runs" and path.name.startswith("cartpole-4-")
    assert TrainTool(seed=2).default_run_dir().name.startswith("CartPole-v1-2-")
