"""ReLU gradient-flow probe: through which ReLU units does gradient actually pass?

For every ``nn.ReLU`` inside the component (or the component itself when it is one), the
gradient at the ReLU's input is dL/dy * 1[x > 0]. A unit passes gradient for a sample when
that product is non-zero, i.e. when the unit was active (y = relu(x) > 0) and received a
non-zero output gradient (non-finite values count as not passing). ``pass_rate[u]`` is
the fraction of samples for which it did; units with pass rate 0 over the window are
``blocked``: their incoming weights got no gradient from the probed loss at all.

Functional ``F.relu`` calls are invisible to module hooks: it refuses a component
without ``nn.ReLU`` modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.plugins import register
from policy_probes.probes.layout import as_unit_rows
from policy_probes.probes.per_layer import activation_layers
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import Drained, unit_rates, unit_share
from policy_probes.probes.weighted import Weighted
from policy_probes.sampling import tensor_rows
from policy_probes.user_errors import ProbeError

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation


@register
class ReLUGradientFlow(Probe):
    """Per ReLU layer and unit: samples seen and samples that passed gradient, from the
    gradient at the output of every ``nn.ReLU`` inside the component (hooks of its own)."""

    name = "relu_gradient_flow"
    maker = "attach_relu_gradient_flow_hooks()"
    direction = "backward"
    events = ("backward",)
    placements = ("phases", "layout", "per_layer", "schedule")
    component_hook = False
    batch_units = True  # per-unit accumulators from per-column reductions
    docs = "docs/probes/relu_gradient_flow.md"
    metrics = {
        "pass_rate": "per unit: share of samples through which gradient passed",
        "mean_pass_rate": "mean of pass_rate over the units",
        "blocked_fraction": "share of units that passed no gradient",
    }
    console = ("mean_pass_rate",)

    def __init__(self) -> None:
        super().__init__()
        #: component -> (ReLU path inside it, module, channels first), resolved at attach
        self.relus: dict[str, list[tuple[str, nn.Module, bool]]] = {}

    def register_component(self, name: str, **settings: Any) -> bool:
        """``layers``: the ReLU modules' paths inside the component; ``layer_names``: ReLU
        path -> the layer it is reported under per layer (both set at attach)."""
        return super().register_component(name, layers=[], layer_names={}, **settings)

    def update(
        self,
        component: str,
        layer: str,
        grad_out: torch.Tensor,
        relu_out: torch.Tensor,
        channels_first: bool = False,
        *,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Add one backward pass through ReLU ``layer``: its output gradient and output."""
        rows = (as_unit_rows(grad_out, channels_first), as_unit_rows(relu_out, channels_first))
        self._push(component, layer, rows, weight=weight)

    def consume(self, batch: Drained) -> None:
        component, stream, (g, out) = batch.component, batch.stream, batch.cols
        # g != 0 (non-finite gradients are 0 in g.clean) and a finite output > 0
        passed = torch.abs(g.clean, out=self.scratch(g.clean)).sign_().mul_(out.positive())
        kept = Weighted(g, batch.weight)  # rows the row mask keeps (all without one)
        self._add(component, f"count:{stream}", kept.finite_count(), COUNT)
        self._add(component, f"passed:{stream}", kept.counts(passed), COUNT)
        self._add(component, f"nonfinite:{stream}", kept.nonfinite_counts(), COUNT)

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        out: dict[str, Any] = {}
        a = {key: t.numpy() for key, t in s.items()}  # numpy: see ReLUActivation
        all_rates, finite_total, nonfinite = [], 0, 0
        for layer in [layer for layer in cfg["layers"] if f"count:{layer}" in a]:
            count, bad = a[f"count:{layer}"], int(a[f"nonfinite:{layer}"].sum())
            rate = unit_rates(a[f"passed:{layer}"], count)
            all_rates.append(rate)
            finite_total += int(count.sum())
            nonfinite += bad
            named = cfg["layer_names"].get(layer)
            if named is not None:  # per layer: probes/<probe>/<component>.<layer>/<metric>
                metrics = _pass_metrics(rate, int(count.sum()), bad)
                out.update(((named, metric), value) for metric, value in metrics.items())
            elif len(cfg["layers"]) > 1 and not cfg.get("per_layer", False):
                out[f"{layer or '<self>'}.pass_rate"] = rate.tolist()
                out[f"{layer or '<self>'}.blocked_fraction"] = unit_share(rate == 0)
        if all_rates:
            out.update(_pass_metrics(np.concatenate(all_rates), finite_total, nonfinite))
        return out

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        return (
            "the nn.ReLU modules inside it: this probe reads the gradient at every ReLU's "
            "output through hooks on those modules, never the component's own gradient"
        )

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        component = obs.component
        if component not in self.relus:
            relus = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ReLU)]
            if not relus:
                raise ProbeError(
                    f"relu_gradient_flow probe on component {component!r}: it holds no "
                    f"nn.ReLU module (functional relu calls cannot be hooked); attach it to a "
                    f"component built with nn.ReLU, or use attach_gradient_flow_hooks() instead"
                )
            settings = self.settings[component]
            settings["layers"] = [n for n, _ in relus]
            settings["per_layer"] = obs.per_layer
            if obs.per_layer:  # a HiddenLayer's ReLU is reported under the HiddenLayer
                settings["layer_names"] = {
                    layer.act_name: layer.name
                    for layer in activation_layers(module)
                    if isinstance(layer.act, nn.ReLU)
                }
            self.relus[component] = [(n, m, obs.resolve_layout(module, n)) for n, m in relus]
        first = self.relus[component][0][0]
        return [
            m.register_forward_hook(obs.timed(self._relu_hook(obs, n, cf, n == first)))
            for n, m, cf in self.relus[component]
        ]

    def _relu_hook(self, obs: Observation, layer: str, channels_first: bool, first: bool) -> Any:
        def hook(_mod: nn.Module, _inputs: Any, output: Any) -> None:
            if not (
                obs.enabled
                and obs.context.phase in obs.phases
                and output.requires_grad
                and torch.is_grad_enabled()
            ):
                return
            relu_out = output.detach()
            try:  # the row-mask rows of this pass, bound in forward order
                weight = obs.bind(relu_out, None, obs.component, channels_first, key=layer)
            except Exception as exc:
                obs.fail(exc)
                return

            def record(grad: torch.Tensor, weight: Any, loss_scale: Any) -> None:
                obs.calls += 1
                if first:  # rows observed: counted at the first ReLU
                    obs.rows += tensor_rows(grad, channels_first)
                self.update(obs.component, layer, grad, relu_out, channels_first, weight=weight)

            obs.tap(output, weight, record)

        return hook


def _pass_metrics(rate: np.ndarray, finite: int, nonfinite: int) -> dict[str, Any]:
    elements = finite + nonfinite
    return {
        "pass_rate": rate.tolist(),
        "mean_pass_rate": float(rate.mean()),
        "blocked_fraction": unit_share(rate == 0),
        "nonfinite_fraction": nonfinite / elements if elements else 0.0,
    }


def attach_relu_gradient_flow_hooks() -> ReLUGradientFlow:
    """The ``relu_gradient_flow`` probe (:class:`ReLUGradientFlow`), placed with ``phases``,
    ``layout``, ``per_layer`` (each ReLU layer under ``<component>.<layer>``, else as ``<relu
    path>.pass_rate`` metrics of the component) and ``schedule``."""
    return ReLUGradientFlow()
