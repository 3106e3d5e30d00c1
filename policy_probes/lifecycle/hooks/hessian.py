"""hessian: curvature of the training loss on the current data.

Power iteration on Hessian-vector products gives the eigenvalue of largest magnitude,
lambda = v^T H v with v <- Hv / ||Hv||; Hutchinson's estimator gives the trace,
tr(H) = E_z[z^T H z] with Rademacher z. Each HVP is one double-backward
(Pearlmutter's trick via ``torch.autograd.grad`` on the gradient with
``create_graph=True``); the gradient graph is built once per firing."""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field

from policy_probes.lifecycle.hook import HookConfig, InterventionHook
from policy_probes.lifecycle.model_context import ModelDataContext, batch_size
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.run_context import RunDataContext


class HessianConfig(HookConfig):
    iters: int = Field(20, ge=1, description="power-iteration steps (at least 1)")
    tol: float = Field(1e-3, gt=0, description="relative change that stops the iteration")
    trace_samples: int = Field(10, ge=0, description="Hutchinson probes; 0 = no trace")
    max_batches: int | None = Field(None, ge=1, description="minibatches in the loss; None = all")
    warm_start: bool = True


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


class HessianOperator:
    """v -> Hv for the loss on a list of minibatches, with the gradient graph kept."""

    def __init__(self, model_ctx: ModelDataContext, batches: list[Any]) -> None:
        self.params = list(model_ctx.named_parameters().values())
        total = sum(batch_size(b) for b in batches)
        self.loss = sum(model_ctx.compute_loss(b) * (batch_size(b) / total) for b in batches)
        grads = torch.autograd.grad(self.loss, self.params, create_graph=True, allow_unused=True)
        self._pairs = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]

    def __call__(self, v: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self._pairs:
            return [torch.zeros_like(p) for p in self.params]
        hv = torch.autograd.grad(
            [g for _, g in self._pairs],
            self.params,
            grad_outputs=[v[i] for i, _ in self._pairs],
            retain_graph=True,
            allow_unused=True,
        )
        return [
            torch.zeros_like(p) if h is None else h.detach()
            for p, h in zip(self.params, hv, strict=True)
        ]


def top_eigenvalue(
    hvp: HessianOperator, v0: list[torch.Tensor], iters: int, tol: float
) -> tuple[float, list[torch.Tensor], int]:
    """Power iteration; returns (eigenvalue of largest magnitude, eigenvector, iterations)."""
    norm = torch.sqrt(_dot(v0, v0))
    v = [x / norm for x in v0]
    lam_prev, lam, it = math.inf, 0.0, 0
    for it in range(1, iters + 1):  # noqa: B007  (it is reported)
        hv = hvp(v)
        lam = float(_dot(v, hv))
        hv_norm = float(torch.sqrt(_dot(hv, hv)))
        if hv_norm == 0.0:
            return 0.0, v, it
        v = [x / hv_norm for x in hv]
        if abs(lam - lam_prev) <= tol * abs(lam):
            break
        lam_prev = lam
    return lam, v, it


def hutchinson_trace(hvp: HessianOperator, samples: int) -> tuple[float, float]:
    """Mean and standard error of z^T H z over Rademacher probes z."""
    values = []
    for _ in range(samples):
        z = [torch.randint(0, 2, p.shape, device=p.device).to(p.dtype) * 2 - 1 for p in hvp.params]
        values.append(float(_dot(z, hvp(z))))
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    var = math.fsum((x - mean) ** 2 for x in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


class HessianHook(InterventionHook):
    """Top eigenvalue (warm-started power iteration) and Hutchinson trace of the loss Hessian."""

    name = "hessian"
    description = "top Hessian eigenvalue (power iteration on HVPs) and Hutchinson trace"
    hook_points = (HookPoint.SNAPSHOT,)
    Config = HessianConfig
    metrics = {
        "top_eigenvalue": "eigenvalue of largest magnitude of the loss Hessian (signed)",
        "iterations": "power iterations used",
        "trace": "Hutchinson estimate of tr(H)",
        "trace_std_error": "standard error of that estimate",
        "loss": "the loss whose Hessian was measured",
    }

    def intervene(self, run_ctx: RunDataContext, model_ctx: ModelDataContext) -> dict[str, Any]:
        batches = list(model_ctx.minibatches())[: self.config.max_batches]  # None: all
        hvp = HessianOperator(model_ctx, batches)
        v0 = self.state.get("v") if self.config.warm_start else None
        if v0 is None or [t.shape for t in v0] != [p.shape for p in hvp.params]:
            v0 = [torch.randn_like(p) for p in hvp.params]
        lam, v, iters = top_eigenvalue(hvp, v0, self.config.iters, self.config.tol)
        self.state["v"] = [t.detach().clone() for t in v]
        loss = float(hvp.loss.detach())
        out: dict[str, Any] = {"top_eigenvalue": lam, "iterations": iters, "loss": loss}
        if self.config.trace_samples > 0:
            out["trace"], out["trace_std_error"] = hutchinson_trace(hvp, self.config.trace_samples)
        return out
