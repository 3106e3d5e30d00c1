"""Weights probe: per-layer parameter norm, distance from initialisation, update ratio.

Parameter-norm growth (Lyle et al., "Disentangling the causes of plasticity loss", 2024)
and how far and fast the weights move (Plasticine's "weight difference from
initialisation" and "weight magnitude"), for every module inside the component holding
parameters of its own (``actor_mlp.layer_0.linear``) and the component as a whole, with θ
the parameters concatenated:

* ``norm`` = ‖θ‖₂
* ``magnitude`` = mean |θ_j|
* ``init_distance`` = ‖θ − θ₀‖ / ‖θ₀‖, θ₀ the parameters when the probe was attached
* ``update_ratio`` = ‖θ − θ_prev‖ / ‖θ_prev‖, θ_prev the parameters at the previous
  report (one epoch's updates at the default sampling)

Read once per report on the parameters' device (the same on every process: no all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.plugins import Rule, register
from policy_probes.probes.probe import Probe
from policy_probes.probes.state import SUM, Device

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

#: the sums one layer contributes, in order
SUMS = ("sq", "abs", "count", "init_sq", "init_diff_sq", "prev_sq", "prev_diff_sq")


@register
class Weights(Probe):
    """The component's layers and their reference parameters (at attach, at the last
    report); the sums are formed in :meth:`to_metrics`."""

    name = "weights"
    maker = "attach_weights_hooks()"
    events = ("epoch_end",)
    placements = ()
    component_hook = False
    docs = "docs/probes/weights.md"
    metrics = {
        "norm": "L2 norm of the layer's parameters",
        "init_distance": "||theta - theta0|| / ||theta0||",
        "update_ratio": "||theta - theta_prev|| / ||theta_prev||, one report apart",
    }
    rules = (
        Rule(
            name="weight_norm_growth",
            title="weight norm grew by half within a few epochs",
            metric="norm",
            direction="rising",
            kind="ratio",
            threshold=1.5,
            floor=1e-6,
            threshold_source="policy-probes default, not from a paper; parameter-norm growth "
            "is one of the three mechanisms of plasticity loss in Lyle et al., 2024",
            docs="docs/probes/weights.md",
            remedies=("l2_init", "soft_shrink_perturb", "policy.layer_norm=true"),
            meaning="the layer's parameter norm is 1.5 times what it was a few epochs before; "
            "large weights make units harder to move, which probes/trainability tests",
        ),
        Rule(
            name="updates_stalled",
            title="updates per unit of learning rate fell thirtyfold",
            metric="update_ratio",
            direction="falling",
            kind="ratio",
            threshold=0.03,
            floor=1e-9,
            divide_by="train/learning_rate",
            threshold_source="policy-probes default, not from a paper; divided by the "
            "learning rate, so an annealed rate is no change",
            docs="docs/probes/weights.md",
            remedies=("soft_shrink_perturb", "l2_init", "reset_layers"),
            meaning="for the same learning rate, each epoch's updates move the layer a thirtieth "
            "or less of what they did a few epochs before (gradients vanished or the "
            "optimizer's second moments grew)",
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        #: component -> layer name ("" = the component's own parameters) -> parameters
        self.layers: dict[str, dict[str, list[nn.Parameter]]] = {}
        #: component -> layer -> [θ₀ copies], [θ_prev copies]
        self.init: dict[str, dict[str, list[torch.Tensor]]] = {}
        self.prev: dict[str, dict[str, list[torch.Tensor]]] = {}

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        self.watch(obs.component, module)
        return []

    def unregister_component(self, name: str) -> None:
        super().unregister_component(name)
        for table in (self.layers, self.init, self.prev):
            table.pop(name, None)

    def watch(self, component: str, module: nn.Module) -> None:
        """Record ``module``'s layers and their parameters now as θ₀ and θ_prev (once)."""
        if component in self.layers:
            return
        layers = {name: list(sub.parameters(recurse=False)) for name, sub in module.named_modules()}
        layers = self.layers[component] = {name: ps for name, ps in layers.items() if ps}
        for table in (self.init, self.prev):
            table[component] = {k: [p.detach().clone() for p in ps] for k, ps in layers.items()}

    def sums(self, component: str) -> torch.Tensor:
        """``(layers, len(SUMS))`` float64 sums on the parameters' device."""
        rows = []
        for name, params in self.layers[component].items():
            cols = [torch.zeros((), dtype=SUM, device=params[0].device) for _ in SUMS]
            for p, p0, pp in zip(
                params, self.init[component][name], self.prev[component][name], strict=True
            ):
                t = p.detach().to(SUM)
                t0, tp = p0.to(SUM), pp.to(SUM)
                cols[0] = cols[0] + t.square().sum()
                cols[1] = cols[1] + t.abs().sum()
                cols[2] = cols[2] + t.numel()
                cols[3] = cols[3] + t0.square().sum()
                cols[4] = cols[4] + (t - t0).square().sum()
                cols[5] = cols[5] + tp.square().sum()
                cols[6] = cols[6] + (t - tp).square().sum()
            rows.append(torch.stack(cols))
        return torch.stack(rows)

    def to_metrics(self) -> dict[str, float | list[float]]:
        out: dict[str, float | list[float]] = {}
        for component, layers in self.layers.items():
            if not layers:
                continue
            try:
                table = self.sums(component).cpu()  # the one transfer per component
            except Exception as exc:  # a probe must never take training down
                self.errors[component] = f"{type(exc).__name__}: {exc}"
                continue
            for name, row in zip(layers, table, strict=True):
                if name:  # a layer inside; the component's own parameters join the total
                    for m, v in _weight_metrics(row).items():
                        out[self.key(f"{component}.{name}", m)] = v
            for m, v in _weight_metrics(table.sum(0)).items():
                out[self.key(component, m)] = v
            for name, params in layers.items():  # the next window's θ_prev
                for pp, p in zip(self.prev[component][name], params, strict=True):
                    pp.copy_(p.detach())
        return out

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["references"] = {"init": self.init, "prev": self.prev}
        return out

    def load_state_dict(self, state: dict[str, Any], device: Device = None) -> None:
        super().load_state_dict(state, device)
        refs = state.get("references") or {}
        for which, table in (("init", self.init), ("prev", self.prev)):
            for component, layers in (refs.get(which) or {}).items():
                if component not in table:
                    continue
                for name, saved in layers.items():
                    for mine, t in zip(table[component].get(name, []), saved, strict=False):
                        mine.copy_(t)


def _weight_metrics(row: torch.Tensor) -> dict[str, float]:
    sq, ab, n, init_sq, init_diff_sq, prev_sq, prev_diff_sq = (float(v) for v in row)
    return {
        "norm": sq**0.5,
        "magnitude": ab / n if n else 0.0,
        "init_distance": (init_diff_sq / init_sq) ** 0.5 if init_sq > 0 else 0.0,
        "update_ratio": (prev_diff_sq / prev_sq) ** 0.5 if prev_sq > 0 else 0.0,
    }


def attach_weights_hooks() -> Weights:
    """The ``weights`` probe (:class:`Weights`, docs/probes/weights.md): per-layer ‖θ‖,
    mean |θ|, ‖θ − θ₀‖/‖θ₀‖ and the update ratio ‖Δθ‖/‖θ‖. θ₀ is taken at attach: attach
    it before training. It takes no placement."""
    return Weights()
