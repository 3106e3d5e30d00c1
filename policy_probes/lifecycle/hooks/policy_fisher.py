"""policy_fisher: the true Fisher information of the policy's action distribution.

F = E_{s ~ rollout, a ~ pi(.|s)} [ (grad_theta log pi(a|s))^2 ]   (diagonal)

Actions are *sampled from the policy* (true Fisher), not taken from the rollout
(empirical Fisher). Per-sample gradients come from ``torch.func.vmap(torch.func.grad)``
through the model context's ``action_log_prob`` (falling back to one backward per sample
when the model cannot be vmapped)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn
from torch.distributions import Distribution

from policy_probes.lifecycle.hook import HookConfig, InterventionHook
from policy_probes.lifecycle.model_context import ModelDataContext
from policy_probes.lifecycle.param_groups import component_groups
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.run_context import RunDataContext

log = logging.getLogger("policy_probes.lifecycle")


class PolicyFisherConfig(HookConfig):
    max_samples: int = Field(256, ge=1, description="observations used (at least 1)")
    method: Literal["auto", "vmap", "loop"] = "auto"
    chunk_size: int | None = Field(None, ge=1, description="vmap chunk; None = all at once")


@contextlib.contextmanager
def _no_distribution_validation() -> Iterator[None]:
    # Argument validation is data-dependent control flow, which vmap cannot trace.
    previous = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(previous)


class _LogProb(nn.Module):
    """``model_ctx.action_log_prob`` as a module, so ``functional_call`` can swap parameters."""

    def __init__(self, model_ctx: ModelDataContext) -> None:
        super().__init__()
        self.policy = model_ctx.model
        self._ctx = [model_ctx]  # a list, so it is not registered as a submodule

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self._ctx[0].action_log_prob(obs, actions)


def per_sample_log_prob_grads_vmap(
    model_ctx: ModelDataContext,
    obs: torch.Tensor,
    actions: torch.Tensor,
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """``name -> (N, *param.shape)`` gradients of log pi(a_i|s_i), one row per sample."""
    wrapper = _LogProb(model_ctx)
    params = {f"policy.{n}": p.detach() for n, p in model_ctx.named_parameters().items()}
    buffers = {f"policy.{n}": b for n, b in model_ctx.model.named_buffers()}

    def log_prob(p: dict[str, torch.Tensor], o: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(wrapper, (p, buffers), (o.unsqueeze(0), a.unsqueeze(0)))
        return out.sum()

    with _no_distribution_validation():
        grads = torch.func.vmap(
            torch.func.grad(log_prob), in_dims=(None, 0, 0), chunk_size=chunk_size
        )(params, obs, actions)
    return {n.removeprefix("policy."): g for n, g in grads.items()}


def per_sample_log_prob_grads_loop(
    model_ctx: ModelDataContext, obs: torch.Tensor, actions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The same with one backward pass per sample."""
    named = model_ctx.named_parameters()
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in named}
    for i in range(obs.shape[0]):
        lp = model_ctx.action_log_prob(obs[i : i + 1], actions[i : i + 1]).sum()
        grads = torch.autograd.grad(lp, list(named.values()), allow_unused=True)
        for (n, p), g in zip(named.items(), grads, strict=True):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(r) for n, r in rows.items()}


class PolicyFisherHook(InterventionHook):
    """Diagonal true Fisher over (evenly spaced) rollout states, one sampled action each."""

    name = "policy_fisher"
    description = "true Fisher of the action distribution (sampled actions), per component trace"
    hook_points = (HookPoint.POST_ROLLOUT,)
    Config = PolicyFisherConfig
    metrics = {
        "trace": "sum over all parameters of E[(d log pi(a|s) / d theta)^2]",
        "<component>/trace": "the same restricted to the component's parameters",
        "<component>/mean": "mean diagonal Fisher over the component's parameters",
        "<component>/max": "largest diagonal Fisher entry in the component",
        "samples": "states used",
    }

    _vmap_ok: bool = True

    def intervene(self, run_ctx: RunDataContext, model_ctx: ModelDataContext) -> dict[str, Any]:
        obs = run_ctx.observations if run_ctx.observations is not None else model_ctx.observations()
        n = obs.shape[0]
        if n > self.config.max_samples:
            obs = obs[torch.linspace(0, n - 1, self.config.max_samples, device=obs.device).long()]
        with torch.no_grad():
            actions = model_ctx.sample_actions(obs)
        grads = None
        if self.config.method == "vmap" or (self.config.method == "auto" and self._vmap_ok):
            try:
                grads = per_sample_log_prob_grads_vmap(
                    model_ctx, obs, actions, self.config.chunk_size
                )
            except Exception as exc:  # not vmappable: backward module hooks, data-dependent flow
                if self.config.method == "vmap":
                    raise
                self._vmap_ok = False
                log.info(
                    "policy_fisher: torch.func.vmap cannot run through this model (%s); using "
                    "one backward pass per sample from now on",
                    exc,
                )
        if grads is None:
            grads = per_sample_log_prob_grads_loop(model_ctx, obs, actions)
        fisher = {name: g.detach().double().square().mean(0) for name, g in grads.items()}
        out: dict[str, Any] = {"samples": float(obs.shape[0])}
        total = torch.zeros((), dtype=torch.float64, device=obs.device)
        for comp, names in component_groups(model_ctx.model).items():
            flat = torch.cat([fisher[n].reshape(-1) for n in names if n in fisher])
            out[f"{comp}/trace"] = flat.sum()
            out[f"{comp}/mean"] = flat.mean()
            out[f"{comp}/max"] = flat.max()
            total = total + flat.sum()
        out["trace"] = total
        return out
