"""The trainer's value-target scale (mean |R|, std R over the valid transitions of the
rollout) against the GAE returns recomputed by the reference loop of the trainer tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_ppo_trainer import T, make_boundary_envs, make_trainer, reference_advantages

from trainers import PPOConfig


def test_value_target_scale_is_that_of_the_valid_returns() -> None:
    envs = make_boundary_envs()
    gamma, lam = 0.9, 0.8
    cfg = PPOConfig(
        total_timesteps=T * 3, num_steps=T, num_minibatches=2, gamma=gamma, gae_lambda=lam
    )
    trainer = make_trainer(envs, cfg)
    trainer.reset_envs()
    trainer.collect_rollout()
    adv, valid, _ = reference_advantages(trainer.policy, gamma, lam)
    returns = [
        float(a + v)
        for a, v, ok in zip(
            adv.reshape(-1),
            trainer.storage.values.numpy().reshape(-1),
            valid.reshape(-1),
            strict=True,
        )
        if ok
    ]
    mean = sum(returns) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
    got = trainer.storage.value_statistics()
    assert got["value_target_abs_mean"] == pytest.approx(
        sum(abs(r) for r in returns) / len(returns), rel=1e-5
    )
    assert got["value_target_std"] == pytest.approx(std, rel=1e-5)
    trainer.update()  # the epoch's statistics carry them
    assert trainer.state.loss_stats["value_target_std"] == pytest.approx(std, rel=1e-5)
    assert np.isfinite(trainer.state.loss_stats["explained_variance"])
    envs.close()
