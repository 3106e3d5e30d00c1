"""Policy and optimizer options the plasticity literature pairs with the remedies:
``policy.layer_norm`` in the built-in MLP and CNN policies (outputs against the layers
written out with torch.nn.functional) and ``trainer.adam_betas`` reaching the optimizer,
also in a fork."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from policy_probes.cli import apply_overrides
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainerHook, TrainTool
from trainers.cnn_policy import CNNActorCriticPolicy
from trainers.policy import ActorCriticPolicy, StackedMLPs


def test_layer_norm_mlp_policy_matches_the_layers_written_out():
    obs_space = gym.spaces.Box(-1, 1, (4,), np.float32)
    torch.manual_seed(0)
    policy = ActorCriticPolicy(
        obs_space,
        gym.spaces.Discrete(2),
        PolicyConfig(hidden_sizes=[8, 6], activation="relu", layer_norm=True),
    )
    with torch.no_grad():  # non-trivial affine parameters
        for m in policy.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(5, 4)

    def mlp(net, h):
        for layer in net.children():
            h = h @ layer.linear.weight.T + layer.linear.bias
            mu, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
            h = (h - mu) / torch.sqrt(var + 1e-5) * layer.norm.weight + layer.norm.bias
            h = h.clamp_min(0)
        return h

    with torch.no_grad():
        logits, value = policy(x)
        want_logits = policy.actor_head(mlp(policy.actor_mlp, x))
        want_value = policy.critic_head(mlp(policy.critic_mlp, x)).squeeze(-1)
        assert torch.allclose(logits, want_logits, atol=1e-6)
        assert torch.allclose(value, want_value, atol=1e-6)
        direct = policy._forward_direct(x)  # the hook-free path keeps the norm
        assert torch.equal(direct[0], logits) and torch.equal(direct[1], value)
    assert StackedMLPs.build(policy) is None  # the stacked rollout path has no norm
    names = [n for n, _ in policy.actor_mlp.named_modules()]
    assert "layer_0.norm" in names
    plain = ActorCriticPolicy(obs_space, gym.spaces.Discrete(2), PolicyConfig())
    assert not any(isinstance(m, nn.LayerNorm) for m in plain.modules())  # off by default


def test_layer_norm_cnn_policy_normalises_every_feature_map():
    space = gym.spaces.Box(0, 255, (4, 36, 36), np.uint8)
    torch.manual_seed(1)
    policy = CNNActorCriticPolicy(
        space, gym.spaces.Discrete(3), PolicyConfig(encoder="nature_cnn", layer_norm=True)
    )
    enc = policy.encoder
    assert all(isinstance(getattr(enc, f"conv_{i}").norm, nn.GroupNorm) for i in range(3))
    assert isinstance(enc.fc.norm, nn.LayerNorm)
    x = torch.randint(0, 256, (2, 4, 36, 36), dtype=torch.uint8)
    with torch.no_grad():
        h = x.float() / 255.0
        for i in range(3):
            layer = getattr(enc, f"conv_{i}")
            h = layer.conv(h)
            flat = h.flatten(1)
            mu = flat.mean(1).view(-1, 1, 1, 1)
            var = flat.var(1, unbiased=False).view(-1, 1, 1, 1)
            h = (h - mu) / torch.sqrt(var + 1e-5)
            h = h * layer.norm.weight.view(1, -1, 1, 1) + layer.norm.bias.view(1, -1, 1, 1)
            h = h.clamp_min(0)
        f = enc.fc.linear(h.flatten(1))
        f = F.relu(F.layer_norm(f, (512,), enc.fc.norm.weight, enc.fc.norm.bias))
        assert torch.allclose(enc(x), f, atol=1e-5)


class Betas(TrainerHook):
    def __init__(self) -> None:
        self.seen = []

    def on_new_training_run(self, state) -> None:
        self.seen.append(tuple(state.optimizer.param_groups[0]["betas"]))

    def on_epoch_end(self, state) -> None:
        self.seen.append(tuple(state.optimizer.param_groups[0]["betas"]))


def tool(run_dir, *overrides) -> TrainTool:
    t = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[8], activation="relu"),
        trainer=PPOConfig(
            total_timesteps=2 * 16 * 2, num_steps=16, num_minibatches=2, update_epochs=1
        ),
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 1, "keep_last": 5},
        sinks={"console": False, "wandb": False, "tensorboard": False},
        torch_threads=1,
        seed=3,
        run_dir=run_dir,
    )
    return apply_overrides(t, list(overrides))


def test_adam_betas_reach_the_optimizer_and_a_fork(tmp_path):
    from policy_probes.runnable import ForkPoint

    default = Betas()
    tool(tmp_path / "a").add_trainer_hook(default).invoke()
    assert set(default.seen) == {(0.9, 0.999)}
    parent = Betas()
    tool(tmp_path / "b", "trainer.adam_betas=[0.99,0.99]").add_trainer_hook(parent).invoke()
    assert set(parent.seen) == {(0.99, 0.99)}
    child = Betas()  # a fork takes the child's betas, not the checkpoint's
    tool(tmp_path / "c", "trainer.adam_betas=[0.95,0.9]").add_trainer_hook(child).invoke(
        fork_from=ForkPoint(tmp_path / "b", 1)
    )
    assert child.seen[-1] == (0.95, 0.9)
    try:
        tool(tmp_path / "d", "trainer.adam_betas=[1.0,0.9]")
    except Exception as exc:
        assert "Adam betas must be in [0, 1)" in str(exc)
    else:
        raise AssertionError("betas of 1.0 were accepted")
