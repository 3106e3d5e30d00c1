"""Contribution-utility probe: continual backprop's per-unit utility and its low-utility fraction.

Continual backprop (CBP; Dohare et al., "Loss of plasticity in deep continual learning",
Nature 2024) scores every hidden unit i by its *contribution utility*, a running average
of how much the unit passes on to the next layer:

    u_i ← η u_i + (1 − η) |h_i| Σ_k |w_ki|

with h_i the unit's activation and w_ki its outgoing weights (column i of the next
layer's weight). CBP updates it every step; this probe once per report, from the
contribution c_i = mean_rows |h_i| × Σ_k |w_ki| (the window's kept rows, the weights at the
report) folded into the running score with ``decay`` η (the first report starts at c_i).
A unit is *low-utility* when its score is at most ``tau`` of the layer's mean score
(normalised like ReDo's dormancy score).

Layers: every activation layer inside the component followed by an ``nn.Linear`` inside it
(the next in module order), and the last one when ``outgoing`` names the module reading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.plugins import Rule, register
from policy_probes.probes.per_layer import activation_layers
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import SUM, Drained, as_floats, as_rows
from policy_probes.probes.weighted import Weighted
from policy_probes.user_errors import ProbeError

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

UTILITY_EPS = 1e-12


@register
class Utility(Probe):
    """Per-unit sums of |h| and counts per scored layer (read through hooks of its own);
    each layer's outgoing weights; the running utility per unit (host, float64)."""

    name = "utility"
    maker = "attach_utility_hooks()"
    placements = ("phases", "schedule")
    component_hook = False
    saved_attributes = ("scores",)
    docs = "docs/probes/utility.md"
    metrics = {
        "utility": "per unit: CBP's running contribution utility",
        "low_utility_fraction": "share of units whose utility is at most tau of the layer mean",
    }
    rules = (
        Rule(
            name="low_utility_units",
            title="units with no contribution are accumulating",
            metric="low_utility_fraction",
            direction="rising",
            kind="level",
            threshold=0.1,
            min_change=0.05,
            threshold_source="policy-probes default, not from a paper; the utility is "
            "continual backprop's (Dohare et al., Nature 2024)",
            docs="docs/probes/utility.md",
            remedies=("continual_backprop", "redo"),
            meaning="units whose contribution |h| * sum|w_out| is negligible next to the layer's",
        ),
    )

    def __init__(
        self, *, outgoing: str | None = None, decay: float = 0.9, tau: float = 0.025
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not tau >= 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        super().__init__(outgoing=outgoing, decay=decay, tau=tau)
        #: layer -> the weight whose columns are the layer's outgoing weights
        self.outgoing: dict[str, torch.Tensor] = {}
        #: layer -> running utility per unit
        self.scores: dict[str, torch.Tensor] = {}
        #: component -> its scored layers (reported name, module), found at attach
        self.scored: dict[str, list[tuple[str, nn.Module]]] = {}

    def update(self, layer: str, h: torch.Tensor, *, weight: torch.Tensor | None = None) -> None:
        self._push(layer, "h", (as_rows(h),), weight=weight)

    def consume(self, batch: Drained) -> None:
        layer, (h,), weight = batch.component, batch.cols, batch.weight
        kept = Weighted(h, weight)
        abs_h = torch.abs(h.clean, out=self.scratch(h.clean))
        self._add(layer, "abs_sum", kept.sums(abs_h))
        self._add(layer, "count", kept.finite_count(), COUNT)

    def summarize(self, layer: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        w = self.outgoing.get(layer)
        if w is None or "count" not in s:
            return {}
        out_sum = w.detach().abs().sum(0).to(SUM).cpu()  # Σ_k |w_ki| per unit i
        count = s["count"]
        if out_sum.shape != count.shape:  # reported like a lost window, training goes on
            self.errors[layer] = (
                f"{count.numel()} units but the outgoing weight has {out_sum.numel()} input "
                f"columns; pass outgoing= naming the module that reads this layer"
            )
            return {}
        seen = count > 0
        mean_abs = s["abs_sum"] / count.clamp(min=1).to(SUM)
        contribution = mean_abs * out_sum
        prev = self.scores.get(layer)
        decay = cfg["decay"]
        score = (
            contribution
            if prev is None or prev.shape != contribution.shape
            else decay * prev + (1 - decay) * contribution
        )
        self.scores[layer] = score
        units = int(seen.sum())
        if not units:
            return {}
        mean = float(score[seen].mean())
        low = score / (mean + UTILITY_EPS) <= cfg["tau"]
        return {
            "utility": as_floats(score),
            "utility_mean": mean,
            "contribution_mean": float(contribution[seen].mean()),
            "low_utility_fraction": float((low & seen).sum()) / units,
        }

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        return "the activation layers inside it, read through hooks of their own"

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        if obs.component not in self.scored:
            self.scored[obs.component] = self._scored_layers(obs, module)
        return [
            obs.inner_hook(
                name, sub, lambda h, weight, name=name: self.update(name, h, weight=weight)
            )
            for name, sub in self.scored[obs.component]
        ]

    def _scored_layers(self, obs: Observation, module: nn.Module) -> list[tuple[str, nn.Module]]:
        order = {id(m): i for i, (_, m) in enumerate(module.named_modules())}
        linears = [(order[id(m)], m) for m in module.modules() if isinstance(m, nn.Linear)]
        settings = self.settings[obs.component]
        tail: nn.Linear | None = None
        if settings["outgoing"] is not None:
            if obs.locate is None:
                raise ProbeError(
                    f"utility probe on {obs.component!r}: outgoing={settings['outgoing']!r} "
                    f"needs the policy to look it up; attach through PolicyAutoBuilder.attach"
                )
            target = obs.locate(settings["outgoing"])
            tail = next((m for m in target.modules() if isinstance(m, nn.Linear)), None)
        out = []
        for layer in activation_layers(module):
            at = order[id(layer.module)]
            nxt = next((m for i, m in linears if i > at and m not in layer.module.modules()), None)
            nxt = nxt if nxt is not None else tail
            if nxt is None:
                continue  # nothing reads it inside the component and no outgoing= given
            name = f"{obs.component}.{layer.name}"
            if self.register_component(name, **settings):
                self.outgoing[name] = nxt.weight
                out.append((name, layer.module))
        return out


def attach_utility_hooks(
    *, outgoing: str | None = None, decay: float = 0.9, tau: float = 0.025
) -> Utility:
    """The ``utility`` probe (:class:`Utility`, docs/probes/utility.md): CBP's contribution
    utility and the low-utility fraction (at most ``tau`` of the layer mean). ``outgoing``
    names the module reading the component's output (``"actor_head"``) so its last layer
    is scored too; ``decay``: η, once per report. Placed with ``phases`` and ``schedule``."""
    return Utility(outgoing=outgoing, decay=decay, tau=tau)
