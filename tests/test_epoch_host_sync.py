"""A whole training run of the built-in trainer with every built-in probe, a remedy at the
epoch end and one at every step, and a lifecycle observer at every step: nothing in the
hot paths waits for the device.

The hot paths are every policy forward of the rollout (``policy.act``) and every
optimizer step of the update (``train_minibatch``: forward, backward with the probes'
hooks, PRE_STEP observers, clipping, the step, POST_STEP remedies). Every tensor method
that reads data back to the host is recorded there, except where the read tensor is a
host tensor on every device (a remedy's seed drawn from its CPU generator), and on CUDA
they also run under ``torch.cuda.set_sync_debug_mode("error")``, so any synchronising
CUDA call raises (:class:`~test_no_host_sync.ForbidHostSync`). Outside them the
loop transfers what it must: the actions to the environments once per step, and once per epoch the rollout's
checks, the update's statistics and the report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from conftest import NO_WANDB
from test_no_host_sync import ForbidHostSync

from policy_probes import (
    attach_churn_hooks,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_preactivation_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
    attach_utility_hooks,
    attach_weights_hooks,
)
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainerHook, TrainTool

EPOCHS = 3
#: functions whose reads are of host tensors on every device: a remedy's seed, one draw
#: from its CPU ``torch.Generator`` (policy_probes/remedies/fresh_init.py)
HOST_READERS = frozenset({"draw_seed"})


class GuardHotPaths(TrainerHook):
    """Wraps the trainer's ``train_minibatch`` and its policy's ``act`` in
    :class:`ForbidHostSync` when the run starts (on CUDA with the sync debug mode
    "error"), and counts their calls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.recorded: list[str] = []
        self.calls = {"act": 0, "train_minibatch": 0}

    def guarded(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            with ForbidHostSync(self.device, HOST_READERS) as forbid:
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.recorded.extend(forbid.calls)

        return call

    def on_new_training_run(self, state: Any) -> None:
        trainer = state.trainer
        trainer.train_minibatch = self.guarded("train_minibatch", trainer.train_minibatch)
        trainer.policy.act = self.guarded("act", trainer.policy.act)


def probed_tool(run_dir: Path, device: torch.device) -> TrainTool:
    tool = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[16, 16], activation="relu"),
        trainer=PPOConfig(
            total_timesteps=EPOCHS * 64, num_steps=32, num_minibatches=2, update_epochs=2
        ),
        device=device.type,
        run_dir=run_dir,
        torch_threads=1,
        probe_budget=None,  # every pass observed: every hook runs at every step
        hooks=["norms"],  # a lifecycle observer at PRE_STEP, PRE_EPOCH and POST_EPOCH
        remedies=[
            "redo@actor_mlp:every_epochs=1",
            "continual_backprop@critic_mlp:replacement_rate=0.05,maturity_threshold=2",
        ],
        **NO_WANDB,
    )
    for component in ("actor_mlp", "critic_mlp"):
        tool.add_training_hook(component, attach_relu_activation_hooks())
        # the saturation probe on ReLU outputs counts nothing useful; it is here for its hooks
        tool.add_training_hook(component, attach_saturated_activation_hooks("tanh"))
        tool.add_training_hook(component, attach_preactivation_hooks())
        tool.add_training_hook(component, attach_weights_hooks())
        tool.add_training_backward_hook(component, attach_fisher_information_hooks())
        tool.add_training_backward_hook(component, attach_gradient_flow_hooks())
        tool.add_training_backward_hook(component, attach_relu_gradient_flow_hooks())
    tool.add_training_hook("actor_mlp", attach_utility_hooks(outgoing="actor_head"))
    tool.add_training_hook("actor_head", attach_churn_hooks(kind="categorical"))
    tool.add_training_hook("critic_head", attach_churn_hooks(kind="value"))
    return tool


def test_hot_paths_of_a_probed_run_never_synchronise(tmp_path: Path, device: torch.device) -> None:
    tool = probed_tool(tmp_path / "run", device)
    guard = GuardHotPaths(device)
    tool.add_trainer_hook(guard)
    result = tool.invoke()
    assert guard.recorded == []
    assert guard.calls["act"] >= EPOCHS * 32  # one per rollout step
    assert guard.calls["train_minibatch"] == EPOCHS * 2 * 2
    # every probe, remedy and observer ran and reported, with no probe disabled
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    epochs = [r for r in records if "probes/relu/actor_mlp/dead_fraction" in r]
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1))
    last = result.metrics
    assert not [k for k in last if k.startswith("probes/errors/")]
    assert result.metrics.get("trainer/hook_errors", 0.0) == 0.0
    for key in (
        "probes/relu/actor_mlp/dead_fraction",
        "probes/saturation_tanh/critic_mlp/saturated_fraction",
        "probes/preactivation/actor_mlp.layer_0.linear/mean_drift",
        "probes/weights/critic_mlp/norm",
        "probes/fisher/actor_mlp/trace",
        "probes/gradient_flow/critic_mlp/rms",
        "probes/utility/actor_mlp.layer_1/low_utility_fraction",
        "probes/churn/actor_head/policy_kl",
        "remedies/redo/actor_mlp/fired",
        "remedies/continual_backprop/critic_mlp/steps",
    ):
        assert key in last, key
    assert any(k.startswith("norms/") for k in last)  # the lifecycle observer
    assert last["remedies/continual_backprop/critic_mlp/steps"] == 4.0
