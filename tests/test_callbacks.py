"""Trainer callbacks: firing order, TrainerState fields, fault isolation, critical, ranks."""

from __future__ import annotations

import logging

import pytest
import torch

import trainers.callbacks as callbacks
from trainers import TrainerHook, TrainTool

torch.set_num_threads(1)


def tiny_tool(tmp_path, device: str = "cpu", **kw) -> TrainTool:
    # max_steps=500: CartPole-v1 truncates episodes at 500 steps, so both greedy evaluation
    # episodes (one per env) end within max_steps whatever the tiny run's policy learned.
    # device: TrainTool's ("cpu" or "cuda").
    return TrainTool(
        run_dir=tmp_path / "run",
        device=device,
        env={"num_envs": 2},
        trainer={
            "total_timesteps": 2 * 2 * 16,
            "num_steps": 16,
            "num_minibatches": 2,
            "update_epochs": 2,
        },
        evaluation={"every_epochs": 1, "episodes": 2, "num_envs": 2, "max_steps": 500},
        checkpoint={"every_epochs": 0, "at_end": False},
        sinks={"console": False, "csv": False, "wandb": False},
        **kw,
    )


class Recorder(TrainerHook):
    def __init__(self):
        self.events = []
        self.snapshots = {}

    def _log(self, name, s):
        self.events.append((name, s.epoch, s.update_epoch, s.mb_idx, s.agent_step, s.context.phase))

    def on_new_training_run(self, s):
        self._log("on_new_training_run", s)

    def on_rollout_start(self, s):
        self._log("on_rollout_start", s)

    def on_rollout_end(self, s):
        self._log("on_rollout_end", s)
        self.snapshots["rollout"] = dict(s.rollout_stats)

    def on_mb_end(self, s):
        self._log("on_mb_end", s)

    def on_train_phase_end(self, s):
        self._log("on_train_phase_end", s)
        self.snapshots["loss"] = dict(s.loss_stats)

    def on_epoch_end(self, s):
        self._log("on_epoch_end", s)
        self.snapshots["eval"] = dict(s.eval_scores)
        self.snapshots["metrics"] = dict(s.metrics)
        self.snapshots["objects"] = (s.policy, s.optimizer, s.trainer.policy, s.num_epochs)

    def on_training_end(self, s):
        self._log("on_training_end", s)


def test_firing_order_and_state_fields(tmp_path, device):
    rec = Recorder()
    tool = tiny_tool(tmp_path, device.type).add_trainer_hook(rec)
    result = tool.invoke()
    names = [e[0] for e in rec.events]
    per_epoch = (
        ["on_rollout_start", "on_rollout_end"]
        + ["on_mb_end"] * 4
        + ["on_train_phase_end", "on_epoch_end"]
    )
    assert names == ["on_new_training_run", *per_epoch, *per_epoch, "on_training_end"]
    mb = [(e[1], e[2], e[3]) for e in rec.events if e[0] == "on_mb_end"]
    assert mb == [(ep, ue, i) for ep in (1, 2) for ue in (0, 1) for i in (0, 1)]
    # agent_step counts env steps, advanced when the rollout is collected
    steps = {(e[0], e[1]): e[4] for e in rec.events}
    assert steps[("on_rollout_start", 1)] == 0 and steps[("on_rollout_end", 1)] == 32
    assert steps[("on_epoch_end", 2)] == 64
    phases = {e[0]: e[5] for e in rec.events}
    assert phases["on_rollout_end"] == "rollout" and phases["on_mb_end"] == "train"
    assert set(rec.snapshots["loss"]) >= {
        "policy_loss",
        "value_loss",
        "entropy",
        "approx_kl",
        "old_approx_kl",
        "clipfrac",
        "explained_variance",
        "learning_rate",
        "grad_norm",
    }
    assert rec.snapshots["rollout"]["valid_fraction"] <= 1.0
    assert rec.snapshots["eval"]["epoch"] == 2.0 and rec.snapshots["eval"]["episodes"] == 2.0
    # the epoch's record was written before the user hook and is in state.metrics
    assert rec.snapshots["metrics"]["eval/return_mean"] == rec.snapshots["eval"]["return_mean"]
    assert rec.snapshots["metrics"]["train/policy_loss"] == rec.snapshots["loss"]["policy_loss"]
    policy, optimizer, trainer_policy, num_epochs = rec.snapshots["objects"]
    assert policy is result.policy is trainer_policy and isinstance(optimizer, torch.optim.Adam)
    assert num_epochs == 2 and result.epochs == 2


class Boom(TrainerHook):
    def __init__(self, critical=False):
        self.critical = critical
        self.calls = 0

    def on_rollout_end(self, s):
        self.calls += 1
        raise RuntimeError("boom")


def test_hook_error_is_logged_and_training_goes_on(tmp_path, caplog, device):
    boom = Boom()
    rec = Recorder()
    with caplog.at_level(logging.ERROR, logger="trainers"):
        tool = tiny_tool(tmp_path, device.type)
        result = tool.add_trainer_hook(boom).add_trainer_hook(rec).invoke()
    assert boom.calls == 2 and result.epochs == 2
    assert result.hook_errors == {"Boom.on_rollout_end": "RuntimeError: boom"}
    assert "Traceback" in caplog.text and "boom" in caplog.text
    # the hook after the failing one still ran each time
    assert sum(1 for e in rec.events if e[0] == "on_rollout_end") == 2
    assert result.metrics["trainer/hook_errors"] == 1.0


def test_critical_hook_stops_training_and_training_end_still_fires(tmp_path, device):
    rec = Recorder()
    tool = tiny_tool(tmp_path, device.type)
    with pytest.raises(RuntimeError, match="boom"):
        tool.add_trainer_hook(rec).add_trainer_hook(Boom(critical=True)).invoke()
    names = [e[0] for e in rec.events]
    assert names[-1] == "on_training_end" and names.count("on_rollout_end") == 1


def test_only_rank_zero_unless_run_on_all_ranks(tmp_path, monkeypatch, device):
    class AllRanks(Recorder):
        run_on_all_ranks = True

    monkeypatch.setattr(callbacks, "current_rank", lambda: 1)
    rank0_only, everywhere = Recorder(), AllRanks()
    tool = tiny_tool(tmp_path, device.type)
    tool.add_trainer_hook(rank0_only).add_trainer_hook(everywhere).invoke()
    assert rank0_only.events == []
    assert [e[0] for e in everywhere.events][0] == "on_new_training_run"


def test_stop_training_ends_after_the_epoch(tmp_path, device):
    class Stop(TrainerHook):
        def on_epoch_end(self, s):
            s.stop_training = True

    tool = tiny_tool(tmp_path, device.type)
    tool.trainer.total_timesteps = 2 * 16 * 5
    tool.checkpoint.at_end = True
    result = tool.add_trainer_hook(Stop()).invoke()
    assert result.epochs == 1 and result.agent_step == 32
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "epoch_000001.pt"
    assert result.eval_scores["epoch"] == 1.0


def test_non_hook_rejected():
    with pytest.raises(TypeError, match="TrainerHook"):
        TrainTool().add_trainer_hook(object())


def test_callback_list_dispatches_to_overriding_and_duck_typed_hooks_added_later() -> None:
    from trainers.callbacks import CallbackList, TrainerHook, TrainerState

    calls: list[str] = []

    class EpochOnly(TrainerHook):
        def on_epoch_end(self, state: TrainerState) -> None:
            calls.append("epoch-only")

    class DuckTyped:  # not a TrainerHook subclass: any object with the method works
        def on_mb_end(self, state: TrainerState) -> None:
            calls.append("duck")

    hooks = CallbackList([EpochOnly()])
    state = TrainerState(None, None, None, None, None, {})  # type: ignore[arg-type]
    hooks.on_mb_end(state)  # nobody listens yet (the listener list is cached)
    hooks.append(DuckTyped())
    hooks.on_mb_end(state)
    hooks.on_epoch_end(state)
    assert calls == ["duck", "epoch-only"]
