"""Same recipe + seed -> bit-identical parameters on one device (the test device: CPU, or
CUDA with deterministic kernels); probes do not change the run."""

from __future__ import annotations

import torch

from recipes.cartpole import train as cartpole
from recipes.pendulum import train as pendulum

torch.set_num_threads(1)


def run(recipe, tmp_path, name, probes=True, device: str = "cpu", **trainer):
    """The recipe's final policy state after training with ``trainer`` overrides, on
    ``device`` (TrainTool's "cpu" or "cuda")."""
    tool = recipe()
    if not probes:
        tool = tool.model_copy(deep=True)
        object.__setattr__(
            tool, "__pydantic_private__", {**tool.__pydantic_private__, "_builders": []}
        )
    tool = tool.model_copy(
        update={
            "run_dir": tmp_path / name,
            "device": device,
            "trainer": tool.trainer.model_copy(update=trainer),
            "wandb": tool.wandb.model_copy(update={"mode": "disabled"}),
            "sinks": tool.sinks.model_copy(update={"console": False}),
            "evaluation": tool.evaluation.model_copy(
                update={"every_epochs": 1, "episodes": 2, "num_envs": 2}
            ),
        }
    )
    return tool.invoke().policy.state_dict()


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cartpole_two_runs_bit_identical(tmp_path, device):
    dev = device.type
    a = run(cartpole, tmp_path, "a", device=dev, total_timesteps=1536)
    b = run(cartpole, tmp_path, "b", device=dev, total_timesteps=1536)
    assert_identical(a, b)
    init = run(cartpole, tmp_path, "c", device=dev, total_timesteps=512, update_epochs=1)
    assert any(not torch.equal(a[k], init[k]) for k in a)  # training did change them


def test_probes_do_not_change_the_trajectory(tmp_path, device):
    with_probes = run(cartpole, tmp_path, "p", device=device.type, total_timesteps=1024)
    without = run(cartpole, tmp_path, "n", probes=False, device=device.type, total_timesteps=1024)
    assert_identical(with_probes, without)


def test_pendulum_two_runs_bit_identical(tmp_path, device):
    kw = {"total_timesteps": 2048, "num_minibatches": 4, "update_epochs": 2}
    a = run(pendulum, tmp_path, "a", device=device.type, **kw)
    assert_identical(a, run(pendulum, tmp_path, "b", device=device.type, **kw))


def test_a_probe_recording_in_the_rollout_does_not_change_the_trajectory(
    tmp_path, monkeypatch, device
):
    """A probe that records during the rollout keeps its hooks installed there, so the
    rollout takes the module path; without it the rollout takes the hook-free fast path
    (stacked actor-critic forward). Both give the same run, bit for bit."""
    from policy_probes import attach_relu_activation_hooks
    from trainers.policy import ActorCriticPolicy

    fast_rollouts = []
    rollout_forward = ActorCriticPolicy.rollout_forward

    def counted(self, example):
        fast_rollouts.append(1)
        return rollout_forward(self, example)

    monkeypatch.setattr(ActorCriticPolicy, "rollout_forward", counted)

    def probed_in_rollout():
        tool = cartpole()
        tool.probe_budget = None  # observed in every rollout, not only at sampled passes
        for component in ("actor_mlp", "critic_mlp.layer_0"):
            tool.add_training_hook(
                component, attach_relu_activation_hooks(), phases=("rollout", "train")
            )
        return tool

    with_probe = run(probed_in_rollout, tmp_path, "r", device=device.type, total_timesteps=1024)
    assert fast_rollouts == []  # hooks were installed in every rollout
    without = run(cartpole, tmp_path, "n", probes=False, device=device.type, total_timesteps=1024)
    assert len(fast_rollouts) == 2  # both rollouts hook-free
    assert_identical(with_probe, without)
