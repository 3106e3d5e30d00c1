"""L2 towards the initial parameters ("L2 Init"; Kumar, Marklund, Van Roy 2023,
"Maintaining Plasticity in Continual Learning via Regenerative Regularization"; in PPO:
Juliani & Ash 2024, "A Study of Plasticity Loss in On-Policy Deep Reinforcement
Learning").

Before every optimizer step (after the loop's clipping) each parameter of the chosen
layers with a gradient gets ``grad <- grad + coef * (theta - theta_0)``, the gradient of
``coef / 2 * ||theta - theta_0||^2``; the loss the loop logs is unchanged. ``theta_0``:
the parameters when the remedy is attached (the run's initialisation, also on resume)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from policy_probes.plugins import register
from policy_probes.remedies.base import RemedyTarget, checked, name_list
from policy_probes.remedies.step_remedy import StepRemedy, StepState
from policy_probes.remedies.structure import chosen_leaves


@dataclass
class L2State(StepState):
    #: (name in the policy, parameter, its value when attached: theta_0) of each chosen one
    params: list[tuple[str, nn.Parameter, torch.Tensor]] = field(default_factory=list)


@register
class L2Init(StepRemedy):
    """L2 Init (Kumar et al., 2023): before every optimizer step, pull the chosen layers'
    parameters towards their initial values (build with :func:`l2_init`)."""

    name = "l2_init"
    setting_names = ("coef", "layers")

    def __init__(
        self,
        *,
        coef: float = 1e-3,
        layers: Sequence[str] | str | None = None,
        seed: int | None = None,
    ) -> None:
        self.coef = checked("coef", coef, lambda v: v > 0, "> 0")
        super().__init__(seed=seed)
        self.layers = name_list(layers)

    def prepare(self, target: RemedyTarget) -> L2State:
        state = L2State()
        for name, module in chosen_leaves("l2_init", target, self.layers):
            for pname, p in module.named_parameters(recurse=False):
                state.params.append((f"{name}.{pname}", p, p.detach().clone()))
        return state

    def before_step(self, target: RemedyTarget, prepared: L2State, generator: Any) -> None:
        with torch.no_grad():
            for _, p, anchor in prepared.params:
                if p.grad is not None:
                    p.grad.add_(p.detach() - anchor, alpha=self.coef)

    def epoch_report(self, target: RemedyTarget, prepared: L2State) -> dict[str, float]:
        with torch.no_grad():
            total = sum((p.detach() - a).double().square().sum() for _, p, a in prepared.params)
        return {"distance": float(torch.as_tensor(total).sqrt())}  # once per epoch

    def state_dict(self, prepared: L2State) -> dict[str, Any]:
        anchors = {n: a.clone() for n, _, a in prepared.params}
        return {**super().state_dict(prepared), "anchors": anchors}

    def load_state_dict(self, prepared: L2State, state: Any) -> None:
        super().load_state_dict(prepared, state)
        saved = state.get("anchors") or {}
        for name, _, anchor in prepared.params:
            if name in saved:
                anchor.copy_(saved[name])


def l2_init(
    coef: float = 1e-3, layers: Sequence[str] | str | None = None, *, seed: int | None = None
) -> L2Init:
    """L2 Init on the component it is attached to (module docstring)."""
    return L2Init(coef=coef, layers=layers, seed=seed)
