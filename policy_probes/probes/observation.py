"""Observation: one probe on one component, the single path from torch hooks to a probe.

Every hook a probe installs (and a builder's plain hook closure) takes the same path:

1. a phase check (no tensor work); forward probes skip a pass inferred to be a rollout;
2. the tensor: the placement's extractor, else the output itself, else the recurrent
   default (``policy_probes.recurrent``); detached;
3. its row-mask rows, bound now (:mod:`policy_probes.row_mask`);
4. the probe's method (:class:`~policy_probes.probes.probe.Probe`), or the closure;
5. the fault rule: a probe that raises is disabled, reported once and counted in
   ``context.probe_errors`` (re-raised when ``context.strict``);
6. one clock: the seconds the probe spent, which the sampler counts as its cost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.extractors import as_extractor, gradient_target
from policy_probes.grad_tap import on_grad
from policy_probes.outputs import describe_output, extractor_example
from policy_probes.probes.layout import check_layout, output_channels_first, resolve_channels_first
from policy_probes.recurrent import default_extractor
from policy_probes.row_mask import bound_weight
from policy_probes.sampling import Schedule, as_schedule, tensor_rows
from policy_probes.torch_internals import in_backward_pass, is_functorch_wrapped_tensor
from policy_probes.user_errors import ProbeError

#: the phases a probe records in unless its placement says otherwise
PROBE_PHASES = frozenset({"train"})
#: every placement argument (:class:`Placement`)
PLACEMENTS = ("phases", "extractor", "layout", "per_layer", "schedule")


@dataclass(frozen=True)
class Placement:
    """Where and when a probe observes: ``phases`` (None: ``("train",)`` for a probe,
    every phase for a plain closure), ``extractor`` (picks the tensor out of a non-tensor
    output, :mod:`policy_probes.extractors`), ``layout`` (where the units are,
    :mod:`policy_probes.probes.layout`), ``per_layer`` (also every layer inside the
    component) and ``schedule`` (which passes, :mod:`policy_probes.sampling`)."""

    phases: frozenset[str] | None = None
    extractor: Any = None
    layout: str = "auto"
    per_layer: bool = True
    schedule: Schedule | None = None

    @classmethod
    def of(cls, takes: Iterable[str], what: str, **given: Any) -> Placement:
        """The placement ``given``, for ``what`` (a probe or closure) taking ``takes``."""
        takes = tuple(takes)
        unknown = [k for k in given if k not in PLACEMENTS]
        if unknown:
            raise TypeError(
                f"unknown placement argument(s) {unknown}: a probe is placed with "
                f"{', '.join(PLACEMENTS)}"
            )
        refused = [k for k in given if k not in takes]
        if refused:
            raise TypeError(
                f"{what} takes no {', '.join(refused)} (it is placed with "
                f"{', '.join(takes) or 'nothing'})"
            )
        phases = given.get("phases")
        if phases is not None:
            phases = frozenset([phases] if isinstance(phases, str) else phases)
            if not phases:
                raise ValueError("phases must name at least one phase, e.g. phases=('train',)")
        return cls(
            phases=phases,
            extractor=as_extractor(given.get("extractor")),
            layout=check_layout(given.get("layout", "auto")),
            per_layer=bool(given.get("per_layer", True)),
            schedule=as_schedule(given.get("schedule")),
        )


#: the placement a plain hook closure takes
CLOSURE_PLACEMENTS = ("phases", "extractor")
log = logging.getLogger("policy_probes")


class Observation:
    """One probe (or plain hook closure) on one component, with its placement: ``probe``
    is its name, ``tracker`` the :class:`~policy_probes.probes.probe.Probe` that measures
    (None for a closure); the sampler reads ``calls``, ``rows`` and ``seconds``."""

    def __init__(
        self,
        tracker: Any,
        component: str,
        context: ComponentContext,
        placement: Placement,
        closure: Callable[..., Any] | None = None,
        label: str = "hook",
    ) -> None:
        self.tracker = tracker
        self.closure = closure
        self.probe = tracker.name if tracker is not None else label
        self.component = component
        self.context = context
        #: None: a closure given no phases records in every phase
        self.phases = placement.phases if placement.phases or tracker is None else PROBE_PHASES
        self.extractor = as_extractor(placement.extractor)
        self.schedule = placement.schedule
        self.layout = placement.layout
        self.per_layer = placement.per_layer
        #: the component's output has its units on axis 1 (resolved at attach)
        self.channels_first = placement.layout == "channels_first"
        #: a closure's direction is its registration's (None until known)
        self.backward: bool | None = None if tracker is None else tracker.backward
        #: it measures through its component hook (not only through :meth:`attach`'s)
        self.component_hook = tracker is None or tracker.component_hook
        #: the sampler picks the passes a probe observes (closures observe every pass)
        self.sampled = tracker is not None
        #: dotted name -> module of the policy (set by ``PolicyAutoBuilder.attach``)
        self.locate: Callable[[str], nn.Module] | None = None
        self.enabled = True
        self.attached = False
        self.calls = 0
        self.rows = 0
        self.seconds = 0.0
        self._warned_transformed = False

    # ------------------------------------------------------------- the path
    def active(self) -> bool:
        """Records now: enabled, in one of its phases, and (forward probes) not in a pass
        inferred to be a rollout (:meth:`ComponentContext.inference_pass`)."""
        if not self.enabled:
            return False
        if self.phases is None:
            return True
        if self.context.phase not in self.phases:
            return False
        return bool(self.backward) or not self.context.inference_pass()

    def extract(self, output: Any, module: nn.Module | None = None) -> torch.Tensor:
        """The tensor read from a component output: the extractor's, else the output,
        else the recurrent default for ``module``."""
        if self.extractor is not None:
            out = self.extractor(output)
            if not isinstance(out, torch.Tensor):
                raise ProbeError(
                    f"the extractor of probe {self.probe!r} on component {self.component!r} "
                    f"returned {describe_output(out)}; it must return a torch.Tensor"
                )
            return out
        if isinstance(output, torch.Tensor):
            return output
        default = default_extractor(module)
        if default is not None:
            return default(output)
        raise ProbeError(
            f"component {self.component!r} returned {describe_output(output)}, not a tensor; "
            f"pass extractor=... where the probe {self.probe!r} is attached to pick the "
            f"tensor (for example {extractor_example(output)})"
        )

    def __call__(self, module: nn.Module, first: Any, second: Any) -> None:
        """The torch hook: ``(module, inputs, output)`` forward, ``(module, grad_input,
        grad_output)`` backward (``grad_input`` None from the gradient tap)."""
        self._deliver(module, first, second, None)

    def _deliver(
        self, module: nn.Module, first: Any, second: Any, weight: torch.Tensor | None
    ) -> None:
        if not self.active():
            return
        if not self.attached or (self.backward and first is not None):
            self.check_plain_call(module, first, second)  # registered as a torch hook
        if self.component_hook:  # else it measures through the hooks attach() installed
            self.call(self._record, module, first, second, weight)

    def _record(
        self, module: nn.Module, first: Any, second: Any, weight: torch.Tensor | None
    ) -> None:
        if self.closure is not None:
            self.calls += 1
            self.closure(module, first, second)
        elif self.backward:
            grad = second[0] if isinstance(second, tuple | list) else second
            if grad is not None and self.transformed(grad):
                return
            self.calls += 1
            if grad is not None:
                self.rows += tensor_rows(grad, self.channels_first)
                self.tracker.record_grad(
                    self, module, _detached(grad), weight, self.context.loss_scale
                )
        else:
            tensor = self.extract(second, module)
            if self.transformed(tensor):
                return
            self.calls += 1
            self.rows += tensor_rows(tensor, self.channels_first)
            weight = self.bind(tensor, module, self.component, self.channels_first)
            self.tracker.record(self, module, _detached(tensor), weight)

    def transformed(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives inside a ``torch.func`` transform (``vmap``, ``grad``):
        a pass such as TorchRL's vmapped value estimate, whose rows are not the batch's
        and have no storage to hold; it is not recorded (a warning says so once)."""
        if not is_functorch_wrapped_tensor(tensor):
            return False
        if not self._warned_transformed:
            self._warned_transformed = True
            log.warning(
                "probe %r on component %r: passes inside a torch.func transform (vmap, "
                "grad) are not recorded",
                self.probe,
                self.component,
            )
        return True

    def bind(
        self,
        tensor: torch.Tensor,
        module: nn.Module | None,
        name: str,
        channels_first: bool,
        key: Any = None,
    ) -> torch.Tensor | None:
        """The row-mask rows of ``tensor``, the output of the module reported as ``name``
        in this pass (None without a mask). ``key`` tells apart the places of one probe
        that count per-step calls (default: ``name``)."""
        key = id(self) if key is None and name == self.component else (id(self), key or name)
        return bound_weight(self.context, tensor, module, name, key, channels_first)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` timed and under the fault rule (None after a fault)."""
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # a probe must never take training down
            self.fail(exc)
            return None
        finally:
            self.seconds += time.perf_counter() - start

    def timed(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """``hook`` (guarding its own faults) with its time added to :attr:`seconds`."""

        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return run

    def inner_hook(
        self,
        name: str,
        module: nn.Module,
        record: Callable[[torch.Tensor, torch.Tensor | None], None],
        channels_first: bool = False,
    ) -> RemovableHandle:
        """A forward hook on ``module`` (reported as ``name``) calling ``record(output,
        weight)`` with its row-mask rows, timed, under the fault rule, in active passes."""

        def bound(output: torch.Tensor, mod: nn.Module) -> None:
            record(output, self.bind(output, mod, name, channels_first))

        def hook(mod: nn.Module, _inputs: Any, output: Any) -> None:
            tensor = isinstance(output, torch.Tensor)
            if self.active() and tensor and not self.transformed(output):
                self.call(bound, output, mod)

        return module.register_forward_hook(hook)

    def tap(
        self,
        output: torch.Tensor,
        weight: torch.Tensor | None,
        compute: Callable[[torch.Tensor, torch.Tensor | None, Any], None],
    ) -> None:
        """Call ``compute(grad, weight, loss_scale)`` with the gradient of ``output``
        (:func:`~policy_probes.grad_tap.on_grad`), timed, under the fault rule."""
        on_grad(output, _GradCall(self, compute, weight))

    def grad_delivery(self, module: nn.Module, tensor: torch.Tensor) -> Callable | None:
        """The gradient hook for ``tensor``, the component's output, delivering through
        :meth:`_deliver` with its row-mask rows bound now (None if binding failed)."""
        try:
            weight = self.bind(tensor, module, self.component, self.channels_first)
        except Exception as exc:
            self.fail(exc)
            return None
        return _ComponentGrad(self, module, weight)

    def fail(self, exc: BaseException) -> None:
        """The fault rule: re-raise when ``context.strict``; else disable this observation,
        record the error in ``context.probe_errors`` and log it once."""
        if self.context.strict:
            raise exc
        self.enabled = False
        msg = f"{type(exc).__name__}: {exc}"
        self.context.probe_errors[f"{self.probe}/{self.component}"] = msg
        log.error(
            "probe %r on component %r raised and is disabled: %s", self.probe, self.component, msg
        )

    # ------------------------------------------------------- set-up
    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Install the probe's hooks inside the component (:meth:`Probe.attach`)."""
        self.attached = True
        if self.tracker is None:
            return []
        return list(self.tracker.attach(self, module))

    def resolve_layout(self, module: nn.Module, sub: str = "") -> bool:
        """Whether the output of ``sub`` (``""``: the component) is read channels first."""
        if self.locate is not None:  # the policy: "auto" can look beyond the component
            name = f"{self.component}.{sub}" if sub else self.component
            return resolve_channels_first(self.layout, self.locate, name)
        if self.layout == "auto" and not sub:
            return bool(output_channels_first(module))
        return resolve_channels_first(self.layout, module.get_submodule, sub)

    def check_plain_call(self, module: nn.Module, first: Any, second: Any) -> None:
        """A call from a torch hook the user registered with this observation directly.
        At the first one: refuse the wrong direction and a component whose measurement
        needs the hooks :meth:`attach` installs (``Probe.plain_call_gaps``); otherwise run
        :meth:`attach` now (it resolves layouts, installs nothing). A full backward hook
        also needs no extractor, one output tensor and (every call) no row mask. Raises
        :class:`ProbeError` (outside the fault rule: a set-up mistake)."""
        if self.backward is None:  # a closure registered directly: its registration says
            self.backward = in_backward_pass()
        if not self.attached:
            if in_backward_pass() != self.backward:
                kind, other = ("backward", "forward") if self.backward else ("forward", "backward")
                register = "full_backward" if self.backward else "forward"
                raise ProbeError(
                    f"probe {self.probe!r} on component {self.component!r} is a {kind} probe "
                    f"but was registered as a {other} hook; register it with "
                    f"module.register_{register}_hook(closure), or {self._attach_advice()}"
                )
            gaps = "" if self.tracker is None else self.tracker.plain_call_gaps(self, module)
            if not gaps:  # attach() now installs nothing and resolves layouts, settings
                late = self.attach(module)
                for handle in late:  # a probe whose gaps do not say what it hooks
                    handle.remove()
                gaps = "the submodules its attach() hooks" if late else ""
            if gaps:
                self.attached = False
                raise ProbeError(
                    f"probe {self.probe!r} on component {self.component!r} was registered "
                    f"directly as a torch hook, which cannot see {gaps}. "
                    f"{self._attach_advice(capital=True)}, or call closure.attach(module) "
                    f"once before the first forward and keep the handles it returns"
                )
            self.attached = True
        if not (self.backward and first is not None) or self.tracker is None:
            return
        if self.extractor is not None:
            raise ProbeError(
                f"probe {self.probe!r} on component {self.component!r} has an extractor; a "
                f"full backward hook receives the gradients of the module's output tensors, "
                f"not of what the extractor picks. {self._attach_advice(capital=True)}"
            )
        if len(second) != 1:
            raise ProbeError(
                f"probe {self.probe!r} on component {self.component!r}: the module returns "
                f"{len(second)} tensors, so a full backward hook cannot tell which gradient "
                f"to read. {self._attach_advice(capital=True)} with extractor=... picking "
                f"the tensor"
            )
        if self.context.row_mask is not None:
            raise ProbeError(
                f"probe {self.probe!r} on component {self.component!r}: a row mask is set, "
                f"and a full backward hook cannot tell which of the gradient's rows belong "
                f"to which forward pass. {self._attach_advice(capital=True)}"
            )

    def _attach_advice(self, capital: bool = False) -> str:
        builder = self.tracker.builder if self.tracker is not None else "the builder"
        backward = ", backward=True" if self.backward else ""
        method = "add_training_backward_hook" if self.backward else "add_training_hook"
        return (
            f"{'A' if capital else 'a'}ttach it with policy.attach({self.component!r}, "
            f"{builder}, context{backward}) (PolicyAutoBuilder; ProbeSession, TrainTool and "
            f"ProbeCallback: {method}({self.component!r}, {builder}))"
        )

    def __repr__(self) -> str:
        return f"Observation({self.probe!r} on {self.component!r})"


@dataclass(slots=True, eq=False)
class _ComponentGrad:
    """``grad -> obs._deliver(module, None, (grad,), weight)``, slotted: a module called
    step by step makes one per step, alive until the backward (fewer objects than a closure)."""

    obs: Observation
    module: nn.Module
    weight: torch.Tensor | None

    def __call__(self, grad: torch.Tensor) -> None:
        self.obs._deliver(self.module, None, (grad,), self.weight)


@dataclass(slots=True, eq=False)
class _GradCall:
    """A gradient subscription of :meth:`Observation.tap` (slotted like :class:`_ComponentGrad`)."""

    obs: Observation
    compute: Callable
    weight: torch.Tensor | None

    def __call__(self, grad: torch.Tensor) -> None:
        obs = self.obs
        if obs.enabled and not obs.transformed(grad):
            obs.call(self.compute, grad, self.weight, obs.context.loss_scale)


def grad_tap(obs: Observation, extractor: Callable | None) -> Callable:
    """The forward hook handing a backward observation its output's gradient."""

    def subscribe(module: nn.Module, output: Any) -> None:
        tensor = gradient_target(output, extractor, obs.component, module)
        if tensor.requires_grad and torch.is_grad_enabled() and not obs.transformed(tensor):
            if obs.closure is not None:
                closure = obs.closure
                on_grad(tensor, lambda g: obs.call(closure, module, None, (g,)))
            else:
                callback = obs.grad_delivery(module, tensor)
                if callback is not None:
                    on_grad(tensor, callback)

    def tap(module: nn.Module, _inputs: Any, output: Any) -> None:
        if obs.active():  # the tensor-hook registration is the probe's cost, under its fault rule
            obs.call(subscribe, module, output)

    return tap


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t
