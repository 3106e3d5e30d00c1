"""norms: gradient norms before clipping, weight norms, update-to-weight ratio and
distance from the initial weights, total and per layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from policy_probes.lifecycle.hook import HookConfig, TrainingHook
from policy_probes.lifecycle.param_groups import layer_groups
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.registry import HookRegistry
from policy_probes.lifecycle.run_context import RunDataContext


class NormsConfig(HookConfig):
    per_layer: bool = True


def _group_norms(
    tensors: dict[str, torch.Tensor], groups: dict[str, list[str]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total L2 norm and L2 norm per group (device tensors; no host transfer)."""
    per = {}
    for layer, names in groups.items():
        present = [tensors[n] for n in names if n in tensors]
        if present:
            per[layer] = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(t) for t in present])
            )
    total = torch.linalg.vector_norm(torch.stack(list(per.values()))) if per else torch.zeros(())
    return total, per


@HookRegistry.register
class NormsHook(TrainingHook):
    """PRE_STEP: gradient norms of the minibatch before clipping (buffered; the epoch
    value is the mean over its steps). POST_EPOCH: weight norms, ratio of the epoch's
    update to the weights, distance from the weights at the first firing."""

    name = "norms"
    runs_model = False  # reads state only; no passes through the model
    description = "gradient norm (pre-clip), weight norm, update/weight ratio, distance from init"
    hook_points = (HookPoint.PRE_EPOCH, HookPoint.PRE_STEP, HookPoint.POST_EPOCH)
    cost = "cheap"
    groups = ("minimal",)
    Config = NormsConfig
    metrics = {
        "grad_norm": "||g||_2 over all parameters at PRE_STEP (before clipping); epoch mean of steps",
        "grad_norm/<layer>": "same per layer (module owning the parameters)",
        "weight_norm": "||theta||_2 at POST_EPOCH",
        "weight_norm/<layer>": "per layer",
        "update_ratio": "||theta_t - theta_{t-1}|| / ||theta_{t-1}|| between consecutive epochs",
        "update_ratio/<layer>": "per layer",
        "dist_from_init": "||theta_t - theta_0||, theta_0 = weights at the hook's first firing",
        "dist_from_init/<layer>": "per layer",
    }

    def _params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        model = ctx.require("model", self.name)
        groups = layer_groups(model)
        params = self._params(model)
        if "init" not in self.state:
            self.state["init"] = {n: t.clone() for n, t in params.items()}
            self.state["prev"] = {n: t.clone() for n, t in params.items()}
        if ctx.point is HookPoint.PRE_EPOCH:
            return {}
        per_layer = self.config.per_layer
        out: dict[str, Any] = {}
        if ctx.point is HookPoint.PRE_STEP:
            grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
            total, per = _group_norms(grads, groups)
            out["grad_norm"] = total
            if per_layer:
                out.update({f"grad_norm/{k}": v for k, v in per.items()})
            return out
        # POST_EPOCH (or any other epoch point)
        prev, init = self.state["prev"], self.state["init"]
        for key, tensors in (
            ("weight_norm", params),
            ("dist_from_init", {n: params[n] - init[n] for n in params if n in init}),
        ):
            total, per = _group_norms(tensors, groups)
            out[key] = total
            if per_layer:
                out.update({f"{key}/{k}": v for k, v in per.items()})
        delta_total, delta = _group_norms(
            {n: params[n] - prev[n] for n in params if n in prev}, groups
        )
        prev_total, prev_per = _group_norms(prev, groups)
        out["update_ratio"] = delta_total / prev_total.clamp_min(1e-12)
        if per_layer:
            for k, v in delta.items():
                out[f"update_ratio/{k}"] = v / prev_per[k].clamp_min(1e-12)
        self.state["prev"] = {n: t.clone() for n, t in params.items()}
        return out
