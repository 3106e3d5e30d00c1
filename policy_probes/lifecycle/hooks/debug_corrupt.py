"""debug_corrupt: proves the guardian by wrecking the training state, then raising."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from policy_probes.lifecycle.hook import DebugInterventionHook, HookConfig
from policy_probes.lifecycle.model_context import ModelDataContext
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.run_context import RunDataContext


class DebugCorruptConfig(HookConfig):
    raise_error: bool = True


class DebugCorruptHook(DebugInterventionHook):
    """Overwrites the weights with NaN and noise, scrambles the gradients, Adam's
    moments, step counts and learning rates, steps the scheduler, reseeds every RNG,
    flips the modules to eval mode, takes an extra optimizer step, then raises. Only
    the ``with_debug`` keyword (or its name) selects it."""

    name = "debug_corrupt"
    description = "DEBUG: corrupts weights, optimizer state, RNG, then raises (guardian test)"
    hook_points = tuple(HookPoint)
    Config = DebugCorruptConfig
    metrics = {"error": "always 1.0 when it raises (that is its purpose)"}

    def intervene(self, run_ctx: RunDataContext, model_ctx: ModelDataContext) -> dict[str, Any]:
        model = model_ctx.model
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(torch.randn_like(p) * 10)
                if i == 0:
                    p.fill_(float("nan"))
                p.grad = torch.full_like(p, 1e6)
        opt = run_ctx.optimizer or getattr(model_ctx, "optimizer", None)
        if opt is not None:
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        # step counts stay positive so the extra optimizer step below runs
                        value.add_(1000) if key == "step" else value.mul_(1e3).add_(7)
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 1000
            opt.step()
        sched = run_ctx.scheduler or getattr(model_ctx, "scheduler", None)
        if sched is not None:
            sched.step()
        torch.manual_seed(1234)
        np.random.seed(1234)
        random.seed(1234)
        torch.rand(10), np.random.rand(10), random.random()
        model.eval()
        if self.config.raise_error:
            raise RuntimeError(
                "debug_corrupt: deliberate failure after corrupting the training state"
            )
        return {"corrupted": 1.0}
