"""ReLU gradient-flow probe: through which ReLU units does gradient actually pass?

For every ``nn.ReLU`` inside the component (or the component itself when it is one), the
gradient at the ReLU's input is dL/dy * 1[x > 0]. A unit passes gradient for a sample when
that product is non-zero, i.e. when the unit was active (y = relu(x) > 0) and received a
non-zero output gradient (non-finite outputs and gradients count as not passing, as the
``relu`` probe counts a non-finite output as not active). ``pass_rate[u]`` is the
fraction of samples for which it did;
units with pass rate 0 over the whole window are ``blocked``: their incoming weights got
no gradient from the probed loss at all.

Functional ``F.relu`` calls are invisible to module hooks; the probe needs ``nn.ReLU``
modules and refuses to attach to a component without one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.hook_types import BackwardHookBuilder, ProbeError, ProbeHook
from policy_probes.probes.layout import as_unit_rows, check_layout, resolve_channels_first
from policy_probes.probes.per_layer import activation_layers
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import Drained, ProbeState, get_state, unit_rates, unit_share
from policy_probes.probes.weighted import Weighted
from policy_probes.row_mask import bound_weight
from policy_probes.sampling import Schedule, as_schedule, tensor_rows, with_schedule


class ReLUGradientFlowState(ProbeState):
    """Per ReLU layer and unit: samples seen and samples that passed gradient."""

    probe = "relu_gradient_flow"

    def register_component(
        self,
        name: str,
        *,
        layers: Iterable[str] = (),
        layer_names: dict[str, str] | None = None,
        **extra: Any,
    ) -> bool:
        """``layers``: the ReLU modules' paths inside the component; ``layer_names``:
        ReLU path -> name of the layer it is reported under (``<name>.<layer>`` keys),
        for the ReLUs reported per layer."""
        return super().register_component(
            name, layers=list(layers), layer_names=dict(layer_names or {}), **extra
        )

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
        """Add one backward pass through ReLU ``layer``: its output gradient and output
        (with ``channels_first``, units on axis 1 and every sample and position a row),
        ``weight``: their row-mask rows."""
        rows = (as_unit_rows(grad_out, channels_first), as_unit_rows(relu_out, channels_first))
        self._push(component, layer, rows, weight=weight)

    def consume(self, batch: Drained) -> None:
        component, stream, (g, out) = batch.component, batch.stream, batch.cols
        # g != 0 (finite: non-finite gradients are 0 in g.clean and never pass) and the
        # unit was active (a finite output > 0)
        passed = torch.abs(g.clean, out=self.scratch(g.clean)).sign_().mul_(out.positive())
        kept = Weighted(g, batch.weight)  # rows the row mask keeps (all without one)
        self._add(component, f"count:{stream}", kept.finite_count(), COUNT)
        self._add(component, f"passed:{stream}", kept.counts(passed), COUNT)
        self._add(component, f"nonfinite:{stream}", kept.nonfinite_total(), COUNT)

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        out: dict[str, Any] = {}
        a = {key: t.numpy() for key, t in s.items()}  # numpy: see ReLUActivationState
        layers = [layer for layer in cfg["layers"] if f"count:{layer}" in a]
        all_rates, finite_total, nonfinite = [], 0, 0
        for layer in layers:
            count = a[f"count:{layer}"]
            rate = unit_rates(a[f"passed:{layer}"], count)
            all_rates.append(rate)
            finite_total += int(count.sum())
            nonfinite += int(a[f"nonfinite:{layer}"])
            named = cfg["layer_names"].get(layer)
            if named is not None:  # per layer: probes/<probe>/<component>.<layer>/<metric>
                layer_elements = int(count.sum()) + int(a[f"nonfinite:{layer}"])
                out[(named, "pass_rate")] = rate.tolist()
                out[(named, "mean_pass_rate")] = float(rate.mean())
                out[(named, "blocked_fraction")] = unit_share(rate == 0)
                out[(named, "nonfinite_fraction")] = (
                    int(a[f"nonfinite:{layer}"]) / layer_elements if layer_elements else 0.0
                )
            elif len(cfg["layers"]) > 1 and not cfg.get("per_layer", False):
                out[f"{layer or '<self>'}.pass_rate"] = rate.tolist()
                out[f"{layer or '<self>'}.blocked_fraction"] = unit_share(rate == 0)
        if not all_rates:
            return out
        rate = np.concatenate(all_rates)
        out["pass_rate"] = rate.tolist()
        out["mean_pass_rate"] = float(rate.mean())
        out["blocked_fraction"] = unit_share(rate == 0)
        elements = finite_total + nonfinite
        out["nonfinite_fraction"] = nonfinite / elements if elements else 0.0
        return out


class ReLUGradientFlowHook(ProbeHook):
    """Measures through tensor hooks on the output of every ``nn.ReLU`` inside the
    component (installed by :meth:`attach`); no hook on the component itself is needed,
    because the component's ``grad_input`` is the gradient at its input, not at its ReLUs.
    ``calls`` counts the ReLU-level backward calls."""

    probe = "relu_gradient_flow"
    builder_name = "attach_relu_gradient_flow_hooks()"
    backward = True
    component_hook = False

    def __init__(
        self,
        tracker: ReLUGradientFlowState,
        *args: Any,
        layout: str = "auto",
        per_layer: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = tracker
        self.layout = check_layout(layout)
        self.per_layer = per_layer
        #: (ReLU path inside the component, module, channels first), resolved at attach
        self.relus: list[tuple[str, nn.Module, bool]] | None = None

    def record_grad(
        self,
        module: nn.Module,
        grad_output: torch.Tensor,
        weight: torch.Tensor | None = None,
        loss_scale: float | torch.Tensor = 1.0,
    ) -> None:
        """Nothing: the gradient at the component's output is not what this probe reads
        (a closure registered directly after :meth:`attach` is called here)."""

    def plain_call_gaps(self, module: nn.Module) -> str:
        return (
            "the nn.ReLU modules inside it: this probe reads the gradient at every ReLU's "
            "output through hooks on those modules, never the component's own gradient"
        )

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        if self.relus is None:
            relus = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ReLU)]
            if not relus:
                raise ProbeError(
                    f"relu_gradient_flow probe on component {self.component!r}: it holds no "
                    f"nn.ReLU module (functional relu calls cannot be hooked); attach it to a "
                    f"component built with nn.ReLU, or use attach_gradient_flow_hooks() instead"
                )
            settings = self.tracker.settings[self.component]
            settings["layers"] = [n for n, _ in relus]
            if self.per_layer:  # a HiddenLayer's ReLU is reported under the HiddenLayer
                settings["layer_names"] = {
                    layer.act_name: layer.name
                    for layer in activation_layers(module)
                    if isinstance(layer.act, nn.ReLU)
                }
            self.relus = [(n, m, self._channels_first(module, n)) for n, m in relus]
        self.attached = True
        return [
            m.register_forward_hook(self.timed(self._relu_hook(n, cf))) for n, m, cf in self.relus
        ]

    def _channels_first(self, module: nn.Module, sub: str) -> bool:
        if self.locate is not None:
            name = f"{self.component}.{sub}" if sub else self.component
            return resolve_channels_first(self.layout, self.locate, name)
        return resolve_channels_first(self.layout, module.get_submodule, sub)

    def _relu_hook(self, layer: str, channels_first: bool) -> Any:
        def hook(_mod: nn.Module, _inputs: Any, output: Any) -> None:
            if not (
                self.enabled
                and self.context.phase in self.phases
                and output.requires_grad
                and torch.is_grad_enabled()
            ):
                return
            relu_out = output.detach()
            try:  # the row-mask rows of this pass, bound in forward order
                weight = bound_weight(
                    self.context, relu_out, None, self.component, (id(self), layer), channels_first
                )
            except Exception as exc:
                self.fail(exc)
                return

            def record(grad: torch.Tensor, *, weight: torch.Tensor | None, loss_scale: Any) -> None:
                self.calls += 1
                if layer == self.relus[0][0]:  # rows observed: counted at the first ReLU
                    self.rows += tensor_rows(grad, channels_first)
                self.tracker.update(
                    self.component, layer, grad, relu_out, channels_first, weight=weight
                )

            self.tap_grad(output, weight, record)

        return hook


def attach_relu_gradient_flow_hooks(
    *,
    phases: Iterable[str] | str = ("train",),
    layout: str = "auto",
    per_layer: bool = True,
    schedule: Schedule | str | None = None,
) -> BackwardHookBuilder:
    """Backward-hook builder for :class:`ReLUGradientFlowState`.

    It reads the ``nn.ReLU`` modules inside the component, never the component's output,
    so it takes no ``extractor``. ``layout``: where the units are (per channel after a
    conv, :mod:`~policy_probes.probes.layout`); ``per_layer``: report each ReLU layer under
    ``<component>.<layer>`` (else as ``<relu path>.pass_rate`` metrics of the component)."""
    check_layout(layout)

    sched = as_schedule(schedule)

    def build(component_name: str, context: ComponentContext) -> ReLUGradientFlowHook | None:
        tracker = get_state(context, "relu_gradient_flow", ReLUGradientFlowState)
        if not tracker.register_component(component_name, per_layer=per_layer):
            return None
        return with_schedule(
            ReLUGradientFlowHook(
                tracker, component_name, context, phases, layout=layout, per_layer=per_layer
            ),
            sched,
        )

    build.probe = "relu_gradient_flow"  # type: ignore[attr-defined]
    return build
