"""The probe contract: a probe is one measurement object, placed when it is attached.

A probe is a subclass of :class:`Probe`, registered with :func:`policy_probes.plugins.register`.
Its class attributes say what it is (``name``, ``direction``, ``events``, ``placements``,
``metrics``, ``rules``, ``console``, ``docs``: the table in docs/components.md); it
measures through :meth:`record` / :meth:`record_grad` (what the component's hook saw),
:meth:`attach` (hooks on layers inside the component) and the accumulators of
:class:`~policy_probes.probes.state.ProbeState`.

An instance carries the probe's settings (``ReLUActivation(tau=0.05)``); attaching it
places it with a :class:`Placement`. The first instance attached in a context becomes its
tracker (``context.model_metrics[name]``), where other instances register their components.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, TypeAlias

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.plugins import Rule
from policy_probes.probes.observation import CLOSURE_PLACEMENTS, Observation, Placement
from policy_probes.probes.state import ProbeState


class Probe(ProbeState):
    """Base of every probe: see the module docstring for the contract."""

    kind: ClassVar[str] = "probe"
    name: ClassVar[str] = "probe"
    direction: ClassVar[Literal["forward", "backward"]] = "forward"
    events: ClassVar[tuple[str, ...]] = ("forward",)
    placements: ClassVar[tuple[str, ...]] = ("phases", "extractor", "schedule")
    metrics: ClassVar[Mapping[str, str]] = {}
    rules: ClassVar[tuple[Rule, ...]] = ()
    console: ClassVar[tuple[str, ...]] = ()
    docs: ClassVar[str] = ""
    #: how users write it, for error messages (default ``"<Class>()"``)
    maker: ClassVar[str] = ""
    #: False when the probe measures only through the hooks :meth:`attach` installs
    component_hook: ClassVar[bool] = True

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        #: the settings components attached through this instance register with
        self.options = dict(settings)

    @property
    def probe(self) -> str:  # the accumulators' name for the keys
        return self.name

    @property
    def backward(self) -> bool:
        """Whether it reads gradients."""
        return self.direction == "backward"

    @property
    def builder(self) -> str:
        """How users write this probe (named in error messages)."""
        return self.maker or f"{type(self).__name__}()"

    # ----------------------------------------------------------- attaching
    def __call__(
        self, component: str, context: ComponentContext, placement: Placement | None = None
    ) -> Observation | None:
        """Attach to ``component`` in ``context`` (the builder protocol): the context's
        instance registers it with these settings; its :class:`Observation`, or None if
        it is registered already."""
        tracker = context.model_metrics.get(self.name)
        if tracker is None:
            tracker = self if self.context is None else type(self)(**self.options)
            tracker.context = context
            context.model_metrics[self.name] = tracker
        elif not isinstance(tracker, type(self)):
            raise TypeError(
                f"context.model_metrics[{self.name!r}] holds a {type(tracker).__name__}, "
                f"expected {type(self).__name__}"
            )
        if not tracker.register_component(component, **self.options):
            return None
        return Observation(tracker, component, context, placement or Placement())

    def register_component(self, name: str, **settings: Any) -> bool:
        """Register ``name`` with this instance's settings, updated by ``settings``."""
        return super().register_component(name, **{**self.options, **settings})

    def place(self, **given: Any) -> Placement:
        """This probe's placement from keywords (:meth:`Placement.of`)."""
        return Placement.of(self.placements, f"probe {self.name!r}", **given)

    # ----------------------------------------------------------- measuring
    def record(
        self, obs: Observation, module: nn.Module, output: torch.Tensor, weight: Any
    ) -> None:
        """Read one forward output of the component (detached) and its row-mask rows."""
        raise NotImplementedError(f"{type(self).__name__} reads no forward output")

    def record_grad(
        self,
        obs: Observation,
        module: nn.Module,
        grad: torch.Tensor,
        weight: Any,
        loss_scale: float | torch.Tensor,
    ) -> None:
        """Read one gradient of the component's output, as :meth:`record`, with the loop's
        ``loss_scale``."""
        raise NotImplementedError(f"{type(self).__name__} reads no gradient")

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        """Install the hooks this probe needs on submodules of ``module`` (the component),
        resolving layers and layouts at the first call; returns their handles."""
        return []

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        """What this probe reads through :meth:`attach`'s hooks, which a plain torch hook
        registration cannot see (empty: nothing)."""
        return ""


#: what ``add_training_hook``/``add_training_backward_hook``/``PolicyAutoBuilder.attach``
#: take: a probe, or a plain builder ``(component, context) -> hook closure | None``
ProbeBuilder: TypeAlias = Probe | Callable[[str, ComponentContext], Callable[..., Any] | None]


def placement_of(builder: ProbeBuilder, **given: Any) -> Placement:
    """The placement of ``builder`` from keywords: checked against what the probe takes
    (a plain builder's closures take :data:`CLOSURE_PLACEMENTS`)."""
    if isinstance(builder, Probe):
        return builder.place(**given)
    name = getattr(builder, "__name__", type(builder).__name__)
    return Placement.of(CLOSURE_PLACEMENTS, f"plain hook builder {name!r}", **given)
