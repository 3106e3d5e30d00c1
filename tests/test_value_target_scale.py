"""The trainer's value-target scale (mean |R|, std R over the valid transitions of the
rollout) against the GAE returns recomputed by the reference loop of the trainer tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_ppo_trainer import GAMMA, LAM, boundary_rollout, reference_advantages


def test_value_target_scale_is_that_of_the_valid_returns() -> None:
    trainer = boundary_rollout(num_minibatches=2)
    adv, valid, _ = reference_advantages(trainer.policy, GAMMA, LAM)
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
    trainer.envs.close()
