"""feature_rank: how many directions the features of a component span on the current
rollout's observations.

With sigma_1 >= ... >= sigma_d the singular values of the feature matrix Phi
(N samples x d units, not centred):

* ``effective_rank`` (Roy & Vetterli, 2007): exp(H(p)), p_k = sigma_k / sum_j sigma_j.
* ``srank`` (Kumar et al., 2021, delta=0.01): min k with sum_{i<=k} sigma_i >= (1-delta) sum_i sigma_i.
* ``stable_rank``: sum_k sigma_k^2 / sigma_1^2.
* ``feature_rank`` (Lyle et al., 2022, epsilon=0.01): #{k : sigma_k / sqrt(N) > epsilon}."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import nn

from policy_probes.lifecycle.hook import HookConfig, TrainingHook
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.run_context import RunDataContext


class FeatureRankConfig(HookConfig):
    components: list[str] | None = None
    max_samples: int = Field(1024, ge=2, description="observations used (at least 2)")
    delta: float = Field(0.01, gt=0, lt=1, description="srank threshold, in (0, 1)")
    epsilon: float = Field(0.01, gt=0, description="feature_rank threshold, > 0")

    @field_validator("components", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


def rank_metrics(
    features: torch.Tensor, delta: float = 0.01, epsilon: float = 0.01
) -> dict[str, torch.Tensor]:
    """The four rank measures of a ``(samples, units)`` feature matrix (float64)."""
    phi = features.reshape(features.shape[0], -1).double()
    n = phi.shape[0]
    s = torch.linalg.svdvals(phi)
    total = s.sum()
    zero = torch.zeros((), dtype=torch.float64, device=phi.device)
    if n == 0 or not bool(total > 0):
        return {k: zero for k in ("effective_rank", "srank", "stable_rank", "feature_rank")}
    p = s / total
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum()
    cum = torch.cumsum(s, 0)
    return {
        "effective_rank": torch.exp(entropy),
        "srank": (cum < (1 - delta) * total).sum().double() + 1,
        "stable_rank": s.square().sum() / s[0].square(),
        "feature_rank": (s / n**0.5 > epsilon).sum().double(),
    }


def default_components(model: nn.Module) -> list[str]:
    """Feature extractors: the top-level components (or children) but single ``nn.Linear`` heads."""
    comps = getattr(model, "components", None)
    items = comps.items() if isinstance(comps, dict) and comps else model.named_children()
    return [n for n, m in items if not isinstance(m, nn.Linear)]


def _module(model: nn.Module, name: str) -> nn.Module:
    get = getattr(model, "get_component", None)
    if get is not None:
        return get(name)
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise KeyError(f"feature_rank: no component {name!r}; available: {names}") from None


def _grab(outputs: dict[str, torch.Tensor], name: str, _m: nn.Module, _i: Any, out: Any) -> None:
    if isinstance(out, torch.Tensor):
        outputs.setdefault(name, out.detach())


class FeatureRankHook(TrainingHook):
    """The ranks of the chosen components' outputs on (evenly spaced) rollout observations."""

    name = "feature_rank"
    description = "effective rank, srank, stable rank, feature rank of component outputs"
    hook_points = (HookPoint.POST_ROLLOUT,)
    cost = "moderate"
    Config = FeatureRankConfig
    metrics = {
        "<component>/effective_rank": "exp entropy of normalised singular values (Roy & Vetterli)",
        "<component>/srank": "srank_delta, delta=0.01 (Kumar et al.)",
        "<component>/stable_rank": "sum sigma^2 / sigma_max^2",
        "<component>/feature_rank": "#singular values of Phi/sqrt(N) above 0.01 (Lyle et al.)",
    }

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        model = ctx.require("model", self.name)
        obs = ctx.require("observations", self.name)
        n = obs.shape[0]
        if n > self.config.max_samples:
            obs = obs[torch.linspace(0, n - 1, self.config.max_samples, device=obs.device).long()]
        names = self.config.components or default_components(model)
        outputs: dict[str, torch.Tensor] = {}
        grab = partial(_grab, outputs)
        handles = [_module(model, n).register_forward_hook(partial(grab, n)) for n in names]
        buffers = [b.detach().clone() for b in model.buffers()]  # e.g. BatchNorm running stats
        try:
            model(obs)
        finally:
            for h in handles:
                h.remove()
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        missing = [n for n in names if n not in outputs]
        if missing:
            raise ValueError(
                f"feature_rank: component(s) {missing} produced no tensor output during "
                f"model(observations); choose others with feature_rank.components=..."
            )
        cfg = self.config
        ranks = {name: rank_metrics(f, cfg.delta, cfg.epsilon) for name, f in outputs.items()}
        return {f"{name}/{key}": v for name, r in ranks.items() for key, v in r.items()}
