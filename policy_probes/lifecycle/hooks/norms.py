"""norms: gradient norms before clipping, weight norms, update-to-weight ratio and
distance from the initial weights, total and per layer."""

from __future__ import annotations

from typing import Any

import torch

from policy_probes.lifecycle.hook import HookConfig, TrainingHook
from policy_probes.lifecycle.param_groups import layer_groups
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.run_context import RunDataContext


class NormsConfig(HookConfig):
    per_layer: bool = True


def _group_norms(
    tensors: dict[str, torch.Tensor], groups: dict[str, list[str]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total L2 norm and L2 norm per group (device tensors; no host transfer)."""
    norm = torch.linalg.vector_norm
    per = {}
    for layer, names in groups.items():
        if present := [norm(tensors[n]) for n in names if n in tensors]:
            per[layer] = norm(torch.stack(present))
    total = norm(torch.stack(list(per.values()))) if per else torch.zeros(())
    return total, per


class NormsHook(TrainingHook):
    """PRE_STEP: gradient norms of the minibatch before clipping (buffered; the epoch
    value is the mean over its steps). POST_EPOCH: weight norms, ratio of the epoch's
    update to the weights, distance from the weights at the first firing."""

    name = "norms"
    runs_model = False  # reads state only; no passes through the model
    description = "gradient norm (pre-clip), weight norm, update/weight ratio, distance from init"
    hook_points = (HookPoint.PRE_EPOCH, HookPoint.PRE_STEP, HookPoint.POST_EPOCH)
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

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        model = ctx.require("model", self.name)
        groups = layer_groups(model)
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        if "init" not in self.state:
            self.state["init"] = {n: t.clone() for n, t in params.items()}
            self.state["prev"] = {n: t.clone() for n, t in params.items()}
        out: dict[str, Any] = {}
        if ctx.point is HookPoint.PRE_EPOCH:
            return out
        if ctx.point is HookPoint.PRE_STEP:
            grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
            self._report(out, "grad_norm", *_group_norms(grads, groups))
            return out
        # POST_EPOCH (or any other epoch point)
        prev, init = self.state["prev"], self.state["init"]
        self._report(out, "weight_norm", *_group_norms(params, groups))
        dist = {n: params[n] - init[n] for n in params if n in init}
        self._report(out, "dist_from_init", *_group_norms(dist, groups))
        delta = {n: params[n] - prev[n] for n in params if n in prev}
        delta_total, delta_per = _group_norms(delta, groups)
        prev_total, prev_per = _group_norms(prev, groups)
        per_layer = self.config.per_layer
        ratios = {k: v / prev_per[k].clamp_min(1e-12) for k, v in delta_per.items() if per_layer}
        self._report(out, "update_ratio", delta_total / prev_total.clamp_min(1e-12), ratios)
        self.state["prev"] = {n: t.clone() for n, t in params.items()}
        return out

    def _report(
        self, out: dict[str, Any], key: str, total: torch.Tensor, per: dict[str, torch.Tensor]
    ) -> None:
        out[key] = total
        if self.config.per_layer:
            out.update({f"{key}/{k}": v for k, v in per.items()})
