"""Pre-activation probe: per-layer pre-activation mean and std, their drift from the first
epochs, and the feature norm of the component's output.

Pre-activation distribution shift is one of the three mechanisms of plasticity loss in
Lyle et al., "Disentangling the causes of plasticity loss in neural networks" (2024): the
pre-activations z = Wx + b drift into saturation or the dead side of a ReLU. The feature
norm (mean ‖y_i‖ of the output rows) is one of Plasticine's metrics.

For every ``nn.Linear`` inside the component (``actor_mlp.layer_0.linear``), with z_iu
the pre-activation of unit u on row i, over the window's (kept) rows:

* μ_u = mean_i z_iu, σ_u = sqrt(mean_i z_iu² − μ_u²)
* ``mean`` = (1/U) Σ_u μ_u, ``std`` = (1/U) Σ_u σ_u
* reference μ_u⁰, σ_u⁰: the same over every row of the first ``reference_epochs`` reports
* ``mean_drift`` = (1/U) Σ_u |μ_u − μ_u⁰| / (σ_u⁰ + 1e-8)
* ``std_ratio`` = (1/U) Σ_u σ_u / (σ_u⁰ + 1e-8)

and for the component's own output y: ``feature_norm`` = mean_i ‖y_i‖₂.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.plugins import register
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import SUM, Drained, as_rows
from policy_probes.probes.weighted import Weighted

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

DRIFT_EPS = 1e-8


@register
class Preactivation(Probe):
    """Per-unit sums of z, z² and counts per layer; the output's row norms; the reference
    sums of the first ``reference_epochs`` reports (host, float64)."""

    name = "preactivation"
    maker = "attach_preactivation_hooks()"
    placements = ("phases", "schedule")
    saved_attributes = ("reference",)
    docs = "docs/probes/preactivation.md"
    metrics = {
        "mean_drift": "per linear layer: mean |mu - mu0| / sigma0 over its units",
        "std_ratio": "per linear layer: mean sigma / sigma0 over its units",
        "feature_norm": "mean L2 norm of the component's output rows",
    }

    def __init__(self, *, reference_epochs: int = 3) -> None:
        if not (isinstance(reference_epochs, int) and reference_epochs >= 1):
            raise ValueError(f"reference_epochs must be an integer >= 1, got {reference_epochs!r}")
        super().__init__(reference_epochs=reference_epochs)
        #: layer -> {"sum", "sq", "count", "windows"} over the first reports
        self.reference: dict[str, dict[str, torch.Tensor]] = {}
        #: component -> its nn.Linear layers (reported name, module), found at attach
        self.linears: dict[str, list[tuple[str, nn.Module]]] = {}

    def update_layer(
        self, layer: str, z: torch.Tensor, *, weight: torch.Tensor | None = None
    ) -> None:
        self._push(layer, "z", (as_rows(z),), weight=weight)

    def consume(self, batch: Drained) -> None:
        component, (x,), weight = batch.component, batch.cols, batch.weight
        kept = Weighted(x, weight)
        if batch.stream == "y":  # row norms of the component output (finite rows)
            norms = torch.linalg.vector_norm(x.clean, dim=1).to(SUM)
            ok = 1.0 - x.row_nonfinite().sign().to(SUM)
            if weight is not None:
                ok = ok * weight.to(SUM)
            self._add(component, "norm_sum", (norms * ok).sum())
            self._add(component, "rows", ok.sum().round().to(COUNT), COUNT)
            return
        self._add(component, "sum", kept.sums(x.clean))
        sq = torch.square(x.clean, out=self.scratch(x.clean))
        self._add(component, "sq", kept.sums(sq))
        self._add(component, "count", kept.finite_count(), COUNT)

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        out: dict[str, float] = {}
        if "rows" in s and int(s["rows"]):
            out["feature_norm"] = float(s["norm_sum"]) / int(s["rows"])
        if "count" not in s:
            return out
        count = s["count"].to(SUM)
        seen = count > 0
        if not bool(seen.any()):
            return out
        mu, sd = _moments(s["sum"], s["sq"], count)
        ref = self.reference.get(component)
        if ref is None or int(ref["windows"]) < cfg["reference_epochs"]:
            now = {"sum": s["sum"], "sq": s["sq"], "count": count}
            if ref is None:  # the first reports build the reference
                ref = self.reference[component] = {k: torch.zeros_like(v) for k, v in now.items()}
                ref["windows"] = torch.zeros((), dtype=COUNT)
            if ref["sum"].shape == s["sum"].shape:
                for key, value in now.items():
                    ref[key] += value
                ref["windows"] += 1
        mu0, sd0 = _moments(ref["sum"], ref["sq"], ref["count"])
        both = seen & (ref["count"] > 0)
        out["mean"] = float(mu[seen].mean())
        out["std"] = float(sd[seen].mean())
        if bool(both.any()) and mu0.shape == mu.shape:
            out["mean_drift"] = float(((mu - mu0).abs() / (sd0 + DRIFT_EPS))[both].mean())
            out["std_ratio"] = float((sd / (sd0 + DRIFT_EPS))[both].mean())
        return out

    def record(
        self, obs: Observation, module: nn.Module, output: torch.Tensor, weight: Any
    ) -> None:
        self._push(obs.component, "y", (as_rows(output),), weight=weight)

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        names = [n for n, m in module.named_modules() if n and isinstance(m, nn.Linear)]
        if not names and not isinstance(module, nn.Linear):
            return ""
        return f"the nn.Linear layers inside it ({', '.join(names) or 'itself'}), read through hooks of their own"

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        component = obs.component
        if component not in self.linears:
            settings = self.settings[component]
            layers = []
            for name, sub in module.named_modules():
                if not isinstance(sub, nn.Linear):
                    continue
                layer = f"{component}.{name}" if name else f"{component}.linear"
                if self.register_component(layer, **settings):
                    layers.append((layer, sub))
            self.linears[component] = layers
        return [
            obs.inner_hook(
                layer,
                sub,
                lambda z, weight, layer=layer: self.update_layer(layer, z, weight=weight),
            )
            for layer, sub in self.linears[component]
        ]


def _moments(total: torch.Tensor, sq: torch.Tensor, count: torch.Tensor) -> tuple:
    n = count.clamp(min=1)
    mu = total / n
    var = (sq / n - mu.square()).clamp(min=0)
    return mu, var.sqrt()


def attach_preactivation_hooks(*, reference_epochs: int = 3) -> Preactivation:
    """The ``preactivation`` probe (:class:`Preactivation`, docs/probes/preactivation.md),
    drift measured from the first ``reference_epochs`` reports; placed with ``phases`` and
    ``schedule``."""
    return Preactivation(reference_epochs=reference_epochs)
