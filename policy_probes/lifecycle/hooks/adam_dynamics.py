"""adam_dynamics: Adam's moments and the step they produce, read from the optimizer."""

from __future__ import annotations

from typing import Any

import torch

from policy_probes.lifecycle.hook import HookConfig, TrainingHook
from policy_probes.lifecycle.param_groups import layer_groups
from policy_probes.lifecycle.run_context import RunDataContext


class AdamDynamicsConfig(HookConfig):
    per_layer: bool = True


class AdamDynamicsHook(TrainingHook):
    """Bias-corrected moments m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t) and
    the effective step lr * m_hat / (sqrt(v_hat) + eps) that Adam applies next (the
    decoupled weight decay of AdamW is not included). Read-only: no guardian needed."""

    name = "adam_dynamics"
    runs_model = False  # reads state only
    description = "Adam first/second moments, effective step, eps-dominated fraction"
    Config = AdamDynamicsConfig
    metrics = {
        "m_abs_mean": "mean |m_hat| over all parameter elements",
        "v_mean": "mean v_hat",
        "sqrt_v_mean": "mean sqrt(v_hat)",
        "step_abs_mean": "mean |lr * m_hat / (sqrt(v_hat) + eps)|",
        "step_abs_max": "max of the same",
        "step_rms": "RMS of the effective step",
        "update_ratio": "||effective step|| / ||theta||",
        "snr_mean": "mean |m_hat| / (sqrt(v_hat) + eps) (1 = perfectly consistent sign)",
        "eps_dominated_fraction": "fraction of elements with sqrt(v_hat) < eps",
        "optimizer_step": "Adam's step count t",
        "step_rms/<layer>": "per layer",
        "update_ratio/<layer>": "per layer",
    }

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        opt = ctx.require("optimizer", self.name)
        model = ctx.require("model", self.name)
        names = {id(p): n for n, p in model.named_parameters()}
        steps: dict[str, torch.Tensor] = {}
        m_abs, v_all, snr, params = [], [], [], []
        eps_count = torch.zeros((), dtype=torch.float64)
        t_max = 0.0
        for group in opt.param_groups:
            beta1, beta2 = group["betas"]
            eps, lr = group["eps"], float(group["lr"])
            for p in group["params"]:
                st = opt.state.get(p)
                if not st or "exp_avg" not in st:
                    continue
                t = float(st["step"])
                t_max = max(t_max, t)
                v = st["max_exp_avg_sq"] if group.get("amsgrad") else st["exp_avg_sq"]
                m_hat = st["exp_avg"].double() / (1 - beta1**t)
                v_hat = v.double() / (1 - beta2**t)
                denom = v_hat.sqrt() + eps
                steps[names.get(id(p), str(id(p)))] = lr * m_hat / denom
                m_abs.append(m_hat.abs().reshape(-1))
                v_all.append(v_hat.reshape(-1))
                snr.append((m_hat.abs() / denom).reshape(-1))
                params.append(p.detach().double().reshape(-1))
                eps_count = eps_count.to(v_hat.device) + (v_hat.sqrt() < eps).sum()
        if not steps:
            raise TypeError(
                f"adam_dynamics reads Adam's exp_avg/exp_avg_sq, but {type(opt).__name__} has no "
                f"such state (yet); use Adam/AdamW or deselect the hook"
            )
        flat_step = torch.cat([s.reshape(-1) for s in steps.values()])
        v_cat = torch.cat(v_all)
        out: dict[str, Any] = {
            "m_abs_mean": torch.cat(m_abs).mean(),
            "v_mean": v_cat.mean(),
            "sqrt_v_mean": v_cat.sqrt().mean(),
            "step_abs_mean": flat_step.abs().mean(),
            "step_abs_max": flat_step.abs().max(),
            "step_rms": flat_step.square().mean().sqrt(),
            "update_ratio": _norm_ratio(flat_step, torch.cat(params)),
            "snr_mean": torch.cat(snr).mean(),
            "eps_dominated_fraction": eps_count / flat_step.numel(),
            "optimizer_step": t_max,
        }
        if self.config.per_layer:
            pmap = dict(model.named_parameters())
            for layer, members in layer_groups(model).items():
                if present := [n for n in members if n in steps]:
                    s = torch.cat([steps[n].reshape(-1) for n in present])
                    w = torch.cat([pmap[n].detach().double().reshape(-1) for n in present])
                    out[f"step_rms/{layer}"] = s.square().mean().sqrt()
                    out[f"update_ratio/{layer}"] = _norm_ratio(s, w)
        return out


def _norm_ratio(step: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(step) / torch.linalg.vector_norm(weights).clamp_min(1e-12)
