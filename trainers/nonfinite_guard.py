"""The non-finite guard: NaN or infinite observations and rewards stop the run.

One NaN in an observation feature makes the loss NaN, then every parameter and every later
checkpoint. So the trainer checks what the environments returned once per rollout, before
the update; a non-finite value stops the run with :class:`NonFiniteInputError` naming the
env, the feature (or the reward) and the step. :func:`check_finite_parameters` is the
second line of defence: a checkpoint is never written with non-finite parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

#: exit status of a run stopped by non-finite inputs or parameters
NONFINITE_EXIT_CODE = 2


class NonFiniteInputError(RuntimeError):
    """An observation or reward of the rollout is NaN or infinite; ``exit_code`` is the
    CLI's exit status."""

    exit_code = NONFINITE_EXIT_CODE


class NonFiniteParametersError(RuntimeError):
    """The policy's parameters are no longer finite; no checkpoint is written. ``fatal``:
    raised from a trainer hook, it ends the run anyway."""

    exit_code = NONFINITE_EXIT_CODE
    fatal = True


def rollout_inputs_finite(obs: torch.Tensor, rewards: np.ndarray, next_obs: Any) -> bool:
    """Whether every stored observation, reward and the bootstrap observation is finite
    (one device reduction, read once; integer observations such as pixels always are)."""
    # a finite sum means every element is finite (a NaN or inf makes the sum NaN or inf);
    # only a sum that overflowed needs the elementwise check
    finite = (
        not obs.is_floating_point()
        or bool(torch.isfinite(obs.sum(dtype=torch.float64)))
        or bool(torch.isfinite(obs).all())
    )
    return finite and bool(np.isfinite(rewards).all()) and bool(np.isfinite(next_obs).all())


def describe_nonfinite_input(
    obs: torch.Tensor,
    rewards: np.ndarray,
    next_obs: Any,
    *,
    epoch: int,
    agent_step: int,
    last_checkpoint: Path | None,
    normalized: bool = False,
) -> str:
    """Where the first non-finite input is (error path only: host transfers are fine).
    ``obs`` is ``(steps, envs, features)``, ``rewards`` ``(steps, envs)``, ``next_obs`` the
    observation after the last step; ``agent_step`` is the count when the rollout began."""
    num_steps, num_envs = obs.shape[0], obs.shape[1]
    last = torch.as_tensor(np.asarray(next_obs)).reshape(1, num_envs, -1).to(obs.dtype)
    full = torch.cat([obs.detach().cpu(), last])
    bad_obs = ~torch.isfinite(full)
    bad_reward = ~np.isfinite(rewards)
    first_obs_step = int(bad_obs.any(dim=(1, 2)).nonzero()[0]) if bad_obs.any() else None
    first_reward_step = int(bad_reward.any(axis=1).nonzero()[0][0]) if bad_reward.any() else None
    if first_obs_step is not None and (
        first_reward_step is None or first_obs_step <= first_reward_step
    ):
        step = first_obs_step
        envs, features = (bad_obs[step].nonzero()[:, i].unique().tolist() for i in (0, 1))
        env = envs[0]
        feature = int(bad_obs[step, env].nonzero()[0])
        value = float(full[step, env, feature])
        what = f"observation feature {feature} = {value}"
        if len(features) > 1:
            what += f" (features {features} are non-finite at this step)"
    else:
        step = first_reward_step
        envs = np.flatnonzero(bad_reward[step]).tolist()
        env = envs[0]
        what = f"reward = {float(rewards[step, env])}"
    where = "the observation after the rollout's last step" if step == num_steps else f"step {step}"
    others = f" (envs {envs} at that step)" if len(envs) > 1 else ""
    spread = (
        " Observation normalisation is on: one env's non-finite feature spreads to that "
        "feature of every env through the running mean."
        if normalized
        else ""
    )
    kept = "no checkpoint was written"
    if last_checkpoint is not None:
        kept = f"the last finite checkpoint is {last_checkpoint}"
    return (
        f"non-finite input from env {env}{others}: {what} at epoch {epoch}, rollout {where} "
        f"(agent step {agent_step + min(step, num_steps) * num_envs + env}); the run stopped "
        f"before training on it and {kept}. Find what produces it in the environment or its "
        f"wrappers (a division by zero, an unbounded state) or bound it with "
        f"env.clip_observation / env.clip_reward.{spread}"
    )


def check_finite_parameters(model: nn.Module, epoch: int) -> None:
    """Raise :class:`NonFiniteParametersError` naming the parameters that are NaN or
    infinite (one host read per call: called once per checkpoint)."""
    params = list(model.named_parameters())
    if not params:
        return
    finite = torch.stack([p.detach().isfinite().all() for _, p in params])
    if bool(finite.all()):
        return
    bad = [name for (name, _), ok in zip(params, finite.tolist(), strict=True) if not ok]
    raise NonFiniteParametersError(
        f"parameters {bad[:6]}{' ...' if len(bad) > 6 else ''} are non-finite at epoch {epoch}; "
        f"no checkpoint was written (the directory keeps the last finite one). Look for a "
        f"non-finite loss in the log (train/nonfinite_loss_steps) and lower "
        f"trainer.learning_rate or check the environment's observations and rewards"
    )
