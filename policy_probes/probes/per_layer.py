"""Per-layer probing: every activation layer inside a component, reported beside it.

With ``per_layer=True`` a probe on ``actor_mlp`` also reads every activation layer inside
it (``probes/<probe>/actor_mlp.layer_0/<metric>``): a :class:`~policy_probes.layers.HiddenLayer`
or :class:`~policy_probes.layers.ConvLayer` (its ``.act`` not counted again) or an
activation module. A layer probed under its own name is left to that registration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.layers import LAYER_BLOCKS
from policy_probes.probes.layout import ACTIVATION_MODULES, as_unit_rows, positions
from policy_probes.probes.observation import PLACEMENTS
from policy_probes.probes.probe import Probe
from policy_probes.user_errors import ProbeError

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

log = logging.getLogger("policy_probes")


@dataclass(frozen=True)
class ActivationLayer:
    """One activation layer inside a component: its path, the module whose output it is,
    the activation module (a HiddenLayer's ``.act``) and that one's path."""

    name: str
    module: nn.Module
    act: nn.Module
    act_name: str


def _is_last(component: nn.Module, path: str) -> bool:
    """Whether the submodule at ``path`` is the last child at every level (its output is
    the component's)."""
    module = component
    for part in path.split("."):
        children = list(module.named_children())
        if not children or children[-1][0] != part:
            return False
        module = children[-1][1]
    return True


def activation_layers(component: nn.Module) -> list[ActivationLayer]:
    """The activation layers strictly inside ``component``, in registration order."""
    out: list[ActivationLayer] = []
    covered: set[int] = set()
    if isinstance(component, LAYER_BLOCKS):
        covered.add(id(component.act))  # the component itself is that layer
    for name, module in component.named_modules():
        if not name or id(module) in covered:
            continue
        if isinstance(module, LAYER_BLOCKS):
            covered.add(id(module.act))
            out.append(ActivationLayer(name, module, module.act, f"{name}.act"))
        elif isinstance(module, ACTIVATION_MODULES):
            out.append(ActivationLayer(name, module, module, name))
    return out


@dataclass(frozen=True)
class ProbedLayer:
    """A layer a probe reads: its reported name, module and layout."""

    component: str
    module: nn.Module
    channels_first: bool


class PerLayerProbe(Probe):
    """A probe on a component's output and, with ``per_layer``, on the output of every
    activation layer inside it that :meth:`selects` (resolved at the first :meth:`attach`).
    :meth:`record`, :meth:`record_grad` and :meth:`record_layer` hand the rows to
    ``update(name, tensor, channels_first, weight=...)``."""

    placements = PLACEMENTS

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        #: component -> the layers it reads (resolved at its first attach)
        self.layers: dict[str, list[ProbedLayer]] = {}
        #: component -> layer -> the layer's hook handle
        self._layer_handles: dict[str, dict[str, RemovableHandle]] = {}
        #: component -> layers read in its current forward (a module run twice is refused)
        self._seen: dict[str, set[str]] = {}
        #: components inside a forward (a layer module called outside it is not read)
        self._inside: dict[str, bool] = {}

    def update(
        self, name: str, rows: torch.Tensor, channels_first: bool, *, weight: Any = None
    ) -> None:
        raise NotImplementedError

    def selects(self, layer: ActivationLayer) -> bool:
        """Whether this probe reads ``layer`` (every activation layer by default)."""
        return True

    def record(
        self, obs: Observation, module: nn.Module, output: torch.Tensor, weight: Any
    ) -> None:
        self.update(obs.component, output, obs.channels_first, weight=weight)

    def record_grad(
        self,
        obs: Observation,
        module: nn.Module,
        grad: torch.Tensor,
        weight: Any,
        loss_scale: float | torch.Tensor,
    ) -> None:
        self.update(obs.component, grad, obs.channels_first, weight=weight)

    def record_layer(
        self, obs: Observation, layer: ProbedLayer, output: torch.Tensor, weight: Any
    ) -> None:
        """Read one forward output of ``layer`` (not detached) and its row-mask rows."""
        self.update(layer.component, output, layer.channels_first, weight=weight)

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        """An observation registered directly as a torch hook sees the component's output
        only (as ``per_layer=False``); with ``per_layer``, one warning names the activation
        layers before the output that it cannot see."""
        if obs.per_layer:
            obs.per_layer = False
            layers = [layer.name for layer in activation_layers(module) if self.selects(layer)]
            inner = [name for name in layers if not _is_last(module, name)]
            if inner:
                log.warning(
                    "probe %r on component %r was registered directly as a torch hook, which "
                    "cannot see the activation layers inside it (%s) that per_layer=True "
                    "reads through hooks of their own; it reports the component's output "
                    "only. %s for every layer",
                    self.name,
                    obs.component,
                    ", ".join(inner),
                    obs._attach_advice(capital=True),
                )
        return ""

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        component = obs.component
        if component not in self.layers:
            # "auto" reads an extracted tensor channels last
            auto_extracted = obs.extractor is not None and obs.layout == "auto"
            obs.channels_first = False if auto_extracted else obs.resolve_layout(module)
            layers = []
            for layer in activation_layers(module) if obs.per_layer else []:
                name = f"{component}.{layer.name}"
                if not self.selects(layer) or not self.claim_component(
                    name, obs, **self.settings[component]
                ):
                    continue  # not this probe's kind of layer, or probed on its own
                layers.append(
                    ProbedLayer(name, layer.module, obs.resolve_layout(module, layer.name))
                )
            self.layers[component] = layers
        handles = self._layer_handles[component] = {
            layer.component: layer.module.register_forward_hook(self._layer_hook(obs, layer))
            for layer in self.layers[component]
            if self.owns(layer.component, obs)
        }
        if not handles:
            return []

        def start(_module: nn.Module, _inputs: Any) -> None:
            self._seen[component] = set()
            self._inside[component] = True

        def end(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            self._inside[component] = False

        return [
            module.register_forward_pre_hook(start),
            module.register_forward_hook(end),
            *handles.values(),
        ]

    def release(self, owner: Any, name: str) -> None:
        """Stop reading layer ``name`` (another registration took it over)."""
        handle = self._layer_handles.get(owner.component, {}).pop(name, None)
        if handle is not None:
            handle.remove()

    def _layer_hook(self, obs: Observation, layer: ProbedLayer) -> Callable[..., None]:
        component = obs.component

        def read(output: torch.Tensor) -> None:
            # the mask rows bound in forward order, as the component hook binds its own
            weight = obs.bind(output, layer.module, layer.component, layer.channels_first)
            self.record_layer(obs, layer, output, weight)

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if not (
                self._inside.get(component)
                and obs.enabled
                and obs.context.phase in obs.phases
                and isinstance(output, torch.Tensor)
                and self.owns(layer.component, obs)
            ):
                return
            seen = self._seen[component]
            if layer.component in seen:
                self._refuse_reused(obs, layer)
                return
            seen.add(layer.component)
            obs.call(read, output)

        return hook

    def _refuse_reused(self, obs: Observation, layer: ProbedLayer) -> None:
        """Stop reading a layer module that runs more than once per forward of the
        component (its uses would mix); reported like a probe fault, for that layer only."""
        msg = (
            f"{layer.component} runs more than once in one forward of {obs.component!r} (the "
            f"same module applied at several places), so its outputs cannot be told apart as "
            f"one layer; it is no longer read per layer. Give each layer its own activation "
            f"module, or attach with per_layer=False"
        )
        if obs.context.strict:
            raise ProbeError(msg)
        self.release(obs, layer.component)
        self.unregister_component(layer.component)
        obs.context.probe_errors[f"{self.name}/{layer.component}"] = msg
        log.error("probe %r: %s", self.name, msg)


class ActivationProbe(PerLayerProbe):
    """Base of the probes fed with a component's activations (``relu``, ``saturation_*``):
    one ``"h"`` stream of unit rows laid out by ``channels_first``."""

    mirrors_identical_rows = True  # consume() writes the accumulators only

    def update(
        self, name: str, h: torch.Tensor, channels_first: bool = False, *, weight: Any = None
    ) -> None:
        """Add a batch of activations: units on the last axis, or on axis 1 with
        ``channels_first`` (every sample and position a row); ``weight``: row-mask rows."""
        if channels_first and h.dim() >= 3:
            self.settings[name]["positions"] = positions(h, channels_first)
        self._push(name, "h", (as_unit_rows(h, channels_first),), weight=weight)
