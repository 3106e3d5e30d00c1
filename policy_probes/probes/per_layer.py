"""Per-layer probing: every activation layer inside a component, reported beside it.

A probe attached to ``actor_mlp`` reads the component's output (the last hidden layer)
and, with ``per_layer=True`` (the default of the activation and gradient-flow probes),
the output of every activation layer inside it, each under its own name
``<component>.<layer>``: keys ``probes/<probe>/actor_mlp.layer_0/<metric>`` beside
``probes/<probe>/actor_mlp/<metric>``. An *activation layer* is a
:class:`~policy_probes.layers.HiddenLayer` or :class:`~policy_probes.layers.ConvLayer`
(its ``.act`` child is the same layer and is not counted again) or an activation module (:data:`~policy_probes.probes.layout.ACTIVATION_MODULES`).

The component's output is often the last layer's output: both keys are reported, and the
tensor is materialised once at the drain (:class:`~policy_probes.probes.rows.DrainRound`
shares block columns that hold the same memory). A layer probed under its own name in
the same context (``actor_mlp.layer_0`` or ``actor_mlp.*`` attached before or after
``actor_mlp``) is left to that registration and its settings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.extractors import as_extractor
from policy_probes.hook_types import Extractor, ProbeError, ProbeHook, log
from policy_probes.layers import LAYER_BLOCKS
from policy_probes.probes.layout import (
    ACTIVATION_MODULES,
    check_layout,
    output_channels_first,
    resolve_channels_first,
)
from policy_probes.probes.state import get_state
from policy_probes.sampling import Schedule, as_schedule, with_schedule


@dataclass(frozen=True)
class ActivationLayer:
    """One activation layer inside a component."""

    #: dotted path inside the component (``"layer_0"``, ``"cnn.1"``)
    name: str
    #: the module whose output is the layer's activation
    module: nn.Module
    #: the activation module itself (the ``.act`` of a HiddenLayer)
    act: nn.Module
    #: dotted path of :attr:`act` inside the component
    act_name: str


def _is_last(component: nn.Module, path: str) -> bool:
    """Whether the submodule at ``path`` is the last child at every level down from
    ``component``: in a sequential stack, the module whose output is the component's."""
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
    """A layer a hook reads: its tracker component name, module and layout."""

    component: str
    module: nn.Module
    channels_first: bool


class LayeredProbeHook(ProbeHook):
    """A probe hook on a component's output and, with ``per_layer``, on the output of
    every activation layer inside it that :meth:`selects`.

    The layers and every layout are resolved once, at the first :meth:`attach` (later
    attaches, when the phase re-arms the hooks, reinstall the same hooks). Subclasses
    implement :meth:`record_layer`; the component's own output goes through
    :meth:`record` / :meth:`record_grad` as for every :class:`ProbeHook`.
    """

    def __init__(
        self,
        tracker: Any,
        component: str,
        context: ComponentContext,
        phases: Iterable[str] | str = ("train",),
        extractor: Extractor | None = None,
        *,
        layout: str = "auto",
        per_layer: bool = True,
    ) -> None:
        super().__init__(component, context, phases, extractor)
        self.tracker = tracker
        self.layout = check_layout(layout)
        self.per_layer = per_layer
        self.channels_first = layout == "channels_first"
        self.layers: list[ProbedLayer] | None = None
        self._layer_handles: dict[str, RemovableHandle] = {}
        #: layers read in the component's current forward (a module run twice is refused)
        self._seen: set[str] = set()
        #: inside a forward of the component: a layer module called on its own (outside
        #: the component, e.g. by a reference computation) is not this component's layer
        self._inside = False

    def selects(self, layer: ActivationLayer) -> bool:
        """Whether this probe reads ``layer`` (every activation layer by default)."""
        return True

    def plain_call_gaps(self, module: nn.Module) -> str:
        """A closure registered directly as a torch hook sees the component's output
        only: it reports the component (as ``per_layer=False``). With ``per_layer``, the
        activation layers before the output, which only :meth:`attach` can hook, are
        named in one warning; a component whose only activation layer is its output
        (``nn.Sequential(nn.Linear, nn.ReLU)``) loses nothing and gets none."""
        if self.per_layer:
            self.per_layer = False
            layers = [layer.name for layer in activation_layers(module) if self.selects(layer)]
            inner = [name for name in layers if not _is_last(module, name)]
            if inner:
                log.warning(
                    "probe %r on component %r was registered directly as a torch hook, which "
                    "cannot see the activation layers inside it (%s) that per_layer=True "
                    "reads through hooks of their own; it reports the component's output "
                    "only. %s for every layer",
                    self.probe,
                    self.component,
                    ", ".join(inner),
                    self._attach_advice(capital=True),
                )
        return ""

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        self.attached = True
        if self.layers is None:
            # an extracted tensor need not be laid out as the module's output: "auto"
            # reads it channels last, an explicit layout is taken as given
            auto_extracted = self.extractor is not None and self.layout == "auto"
            self.channels_first = False if auto_extracted else self.resolve(module, "")
            layers = []
            for layer in activation_layers(module) if self.per_layer else []:
                name = f"{self.component}.{layer.name}"
                if not self.selects(layer) or not self.tracker.claim_component(
                    name, self, **self.tracker.settings[self.component]
                ):
                    continue  # not this probe's kind of layer, or probed on its own
                layers.append(ProbedLayer(name, layer.module, self.resolve(module, layer.name)))
            self.layers = layers
        self._layer_handles = {
            layer.component: layer.module.register_forward_hook(self._layer_hook(layer))
            for layer in self.layers
            if self.tracker.owns(layer.component, self)
        }
        if not self._layer_handles:
            return []
        return [
            module.register_forward_pre_hook(self._start_forward),
            module.register_forward_hook(self._end_forward),
            *self._layer_handles.values(),
        ]

    def _start_forward(self, _module: nn.Module, _inputs: Any) -> None:
        self._seen.clear()
        self._inside = True

    def _end_forward(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        self._inside = False

    def _refuse_reused(self, layer: ProbedLayer) -> None:
        """Stop reading a layer module that runs more than once per forward of the
        component (one activation module applied after several layers): its uses would
        mix into one layer's statistics. Reported like a probe fault, for that layer only."""
        msg = (
            f"{layer.component} runs more than once in one forward of {self.component!r} (the "
            f"same module applied at several places), so its outputs cannot be told apart as "
            f"one layer; it is no longer read per layer. Give each layer its own activation "
            f"module, or attach with per_layer=False"
        )
        if self.context.strict:
            raise ProbeError(msg)
        self.release(layer.component)
        self.tracker.unregister_component(layer.component)
        self.context.probe_errors[f"{self.probe}/{layer.component}"] = msg
        log.error("probe %r: %s", self.probe, msg)

    def release(self, name: str) -> None:
        """Stop reading layer ``name`` (another registration took it over)."""
        handle = self._layer_handles.pop(name, None)
        if handle is not None:
            handle.remove()

    def resolve(self, module: nn.Module, sub: str) -> bool:
        """Whether the output of ``sub`` inside the component (``""``: the component) is
        read channels first (see :mod:`~policy_probes.probes.layout`)."""
        if self.locate is not None:  # the policy: "auto" can look beyond the component
            name = f"{self.component}.{sub}" if sub else self.component
            return resolve_channels_first(self.layout, self.locate, name)
        if self.layout == "auto" and not sub:
            return bool(output_channels_first(module))
        return resolve_channels_first(self.layout, module.get_submodule, sub)

    def _layer_hook(self, layer: ProbedLayer) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if not (
                self._inside
                and self.enabled
                and self.context.phase in self.phases
                and isinstance(output, torch.Tensor)
                and self.tracker.owns(layer.component, self)
            ):
                return
            if layer.component in self._seen:
                self._refuse_reused(layer)
                return
            self._seen.add(layer.component)
            # the mask rows bound in forward order, as the component hook binds its own
            args = (layer, output)
            self.masked_call(
                self.record_layer, args, output, layer.module, layer.component, layer.channels_first
            )

        return hook

    def record(
        self, module: nn.Module, output: torch.Tensor, weight: torch.Tensor | None = None
    ) -> None:
        """The component's output into the tracker."""
        self.tracker.update(self.component, output, self.channels_first, weight=weight)

    def record_grad(
        self,
        module: nn.Module,
        grad: torch.Tensor,
        weight: torch.Tensor | None = None,
        loss_scale: float | torch.Tensor = 1.0,
    ) -> None:
        """The gradient at the component's output into the tracker."""
        self.tracker.update(self.component, grad, self.channels_first, weight=weight)

    def record_layer(
        self, layer: ProbedLayer, output: torch.Tensor, weight: torch.Tensor | None = None
    ) -> None:
        """Read one forward output of ``layer`` (not detached; by default into the
        tracker); ``weight``: the row-mask rows of ``output`` (None without a mask), for
        its pushes, now or from a gradient hook."""
        self.tracker.update(layer.component, output, layer.channels_first, weight=weight)


def layered_builder(
    key: str,
    state: tuple[type, ...],
    hook_cls: type[LayeredProbeHook],
    settings: dict[str, Any],
    *,
    phases: Iterable[str] | str,
    extractor: Extractor | None,
    layout: str,
    per_layer: bool,
    schedule: Schedule | str | None,
) -> Callable[[str, ComponentContext], LayeredProbeHook | None]:
    """The builder of a :class:`LayeredProbeHook` probe: the tracker ``state`` (its class
    and constructor arguments) under ``key`` in the context, ``component`` registered
    there with ``settings``, and a ``hook_cls`` hook on its schedule (None if the
    component is registered already). Checks ``layout``, ``extractor`` and ``schedule``
    when the builder is made, so a bad argument fails in the recipe line that passed it."""
    check_layout(layout)
    extractor = as_extractor(extractor)
    sched = as_schedule(schedule)
    state_cls, *state_args = state

    def build(component_name: str, context: ComponentContext) -> LayeredProbeHook | None:
        tracker = get_state(context, key, state_cls, *state_args)
        if not tracker.register_component(component_name, **settings):
            return None
        hook = hook_cls(
            tracker, component_name, context, phases, extractor, layout=layout, per_layer=per_layer
        )
        return with_schedule(hook, sched)

    build.probe = key  # type: ignore[attr-defined]
    return build
