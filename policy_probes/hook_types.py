"""The contract between hook builders, the closures they return, and the policy.

A *builder* is ``(component_name, context) -> closure | None``. It gets or creates its
tracker in ``context.model_metrics``, registers the component there, and returns a
closure that updates the tracker, or ``None`` when the component is already registered.

* :data:`HookBuilder` closures are forward hooks ``(module, inputs, output) -> None``.
* :data:`BackwardHookBuilder` closures are backward hooks
  ``(module, grad_input, grad_output) -> None``.
* :data:`ProbeBuilder` is either.

The built-in closures are :class:`ProbeHook` objects. Besides being callable they carry
``extractor`` (how to pick the tensor out of a non-tensor output), ``phases`` (when they
record) and an optional :meth:`ProbeHook.attach` that installs hooks on submodules (the
Fisher probe caches the input of every ``nn.Linear`` inside the component this way).

A closure may also be registered directly, ``module.register_forward_hook(closure)`` or
``module.register_full_backward_hook(closure)``: it then computes the same metrics as
through ``PolicyAutoBuilder.attach``, or, where it would need the hooks :meth:`attach`
installs (layers inside the component, the Fisher's per-parameter part), a row mask, or
an extractor on a gradient, it raises :class:`ProbeError` at its first call naming
what to call instead (see :meth:`ProbeHook.check_plain_call`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.extractors import Extractor, as_extractor  # Extractor re-exported
from policy_probes.grad_tap import on_grad
from policy_probes.outputs import describe_output, extractor_example
from policy_probes.recurrent import default_extractor
from policy_probes.row_mask import bound_weight
from policy_probes.sampling import Schedule, tensor_rows
from policy_probes.torch_internals import in_backward_pass
from policy_probes.user_errors import ProbeError  # re-exported: users import it here

log = logging.getLogger("policy_probes")

ForwardHook: TypeAlias = Callable[[nn.Module, tuple[Any, ...], Any], None]
BackwardHook: TypeAlias = Callable[[nn.Module, Any, Any], None]
HookBuilder: TypeAlias = Callable[[str, ComponentContext], ForwardHook | None]
BackwardHookBuilder: TypeAlias = Callable[[str, ComponentContext], BackwardHook | None]
#: a builder of either direction (what ``add_training_hook`` and
#: ``add_training_backward_hook`` take)
ProbeBuilder: TypeAlias = HookBuilder | BackwardHookBuilder


def normalize_phases(phases: str | Iterable[str]) -> frozenset[str]:
    """Accept ``"train"`` or ``("train", "rollout")``; reject empty selections."""
    out = frozenset([phases] if isinstance(phases, str) else phases)
    if not out:
        raise ValueError("phases must name at least one phase, e.g. phases=('train',)")
    return out


#: a short description (keys, length or type), never the contents
describe_type = describe_output


def disable_after_fault(hook: Any, exc: BaseException) -> None:
    """The fault rule shared by every probe hook: re-raise when ``context.strict``;
    otherwise disable ``hook`` for the rest of the run, record the error under
    ``"<probe>/<component>"`` in ``context.probe_errors`` and log it (once: a disabled
    hook is never called into again)."""
    if hook.context.strict:
        raise exc
    hook.enabled = False
    msg = f"{type(exc).__name__}: {exc}"
    hook.context.probe_errors[f"{hook.probe}/{hook.component}"] = msg
    log.error(
        "probe %r on component %r raised and is disabled: %s", hook.probe, hook.component, msg
    )


class ProbeHook:
    """Base of the closures returned by the built-in builders.

    Subclasses implement :meth:`record` (forward) or :meth:`record_grad` (backward) with
    detached tensors. The call path checks the phase (a string comparison, no tensor
    work) and guards against faults: a probe that raises is disabled, reported once and
    counted in ``context.probe_errors`` unless ``context.strict`` is set.
    """

    probe: str = "probe"
    backward: bool = False
    #: False when the probe measures only through the hooks :meth:`attach` installs
    component_hook: bool = True
    #: dotted name -> module of the policy the probe is attached to (set by
    #: ``PolicyAutoBuilder.attach``), so a probe can look at the modules around its component
    locate: Callable[[str], nn.Module] | None = None
    #: whether the component's output is read with its units on axis 1 (conv layouts,
    #: set by the probes that take ``layout=``); the row mask is bound per sample then
    channels_first: bool = False
    #: the public builder that makes this closure (named in error messages)
    builder_name: str = "the probe's attach_*_hooks()"
    #: True once :meth:`attach` has run on the component (``PolicyAutoBuilder.attach``
    #: runs it before the first forward); False: the closure was registered directly
    #: (``self.attached``, set in ``__init__``)

    #: which passes the probe observes (``None``: the context's sampler default; see
    #: :mod:`policy_probes.sampling`); set by the builders' ``schedule=``
    schedule: Schedule | None = None
    #: the sampler picks the passes it observes (plain closures observe every pass)
    sampled: bool = True
    #: seconds spent in this hook's bodies and rows it read since the sampler last looked
    seconds: float = 0.0
    rows: int = 0

    def __init__(
        self,
        component: str,
        context: ComponentContext,
        phases: Iterable[str] | str = ("train",),
        extractor: Extractor | None = None,
    ) -> None:
        self.component = component
        self.context = context
        self.phases = normalize_phases(phases)
        self.extractor = as_extractor(extractor)
        self.enabled = True
        self.calls = 0
        self.attached = False

    # ----------------------------------------------------------------- dispatch
    def active(self) -> bool:
        """Records now: enabled, in one of its phases, and (forward probes) not in a pass
        the context infers to be a rollout (:meth:`ComponentContext.inference_pass`)."""
        if not (self.enabled and self.context.phase in self.phases):
            return False
        return self.backward or not self.context.inference_pass()

    def extract(self, output: Any, module: nn.Module | None = None) -> torch.Tensor:
        """The tensor this probe reads from a component output: the extractor's, else the
        output itself, else the recurrent default for ``module`` (``policy_probes.recurrent``)."""
        if self.extractor is not None:
            out = self.extractor(output)
            if not isinstance(out, torch.Tensor):
                raise ProbeError(
                    f"the extractor of probe {self.probe!r} on component {self.component!r} "
                    f"returned {describe_type(out)}; it must return a torch.Tensor"
                )
            return out
        if isinstance(output, torch.Tensor):
            return output
        default = default_extractor(module)
        if default is not None:
            return default(output)
        raise ProbeError(
            f"component {self.component!r} returned {describe_type(output)}, not a tensor; "
            f"pass extractor=... to the builder of probe {self.probe!r} to pick the tensor "
            f"(for example {extractor_example(output)})"
        )

    def __call__(self, module: nn.Module, first: Any, second: Any) -> None:
        self._dispatch(module, first, second, None)

    def _dispatch(
        self, module: nn.Module, first: Any, second: Any, weight: torch.Tensor | None
    ) -> None:
        """The hook body; ``weight``: the row-mask rows :meth:`grad_callback` bound in the
        forward for a gradient (a forward call binds its tensor's now), see :meth:`call_with`."""
        if not self.active():
            return
        if not self.attached or (self.backward and first is not None):
            self.check_plain_call(module, first, second)  # registered as a torch hook
        start = time.perf_counter()
        try:
            self.calls += 1
            # detached tensors: trackers hold them until they reduce, without a graph
            if self.backward:
                grad = second[0] if isinstance(second, tuple | list) else second
                if grad is not None:
                    self.rows += tensor_rows(grad, self.channels_first)
                    args = (module, _detached(grad))
                    self.call_with(self.record_grad, args, weight, self.context.loss_scale)
            else:
                tensor = self.extract(second, module)
                self.rows += tensor_rows(tensor, self.channels_first)
                weight = bound_weight(
                    self.context, tensor, module, self.component, id(self), self.channels_first
                )
                self.call_with(self.record, (module, _detached(tensor)), weight)
        except Exception as exc:  # a probe must never take training down
            self.fail(exc)
        finally:
            self.seconds += time.perf_counter() - start

    def call_with(
        self,
        fn: Callable[..., None],
        args: tuple[Any, ...],
        weight: torch.Tensor | None,
        loss_scale: float | torch.Tensor | None = None,
    ) -> None:
        """``fn(*args, weight=weight)``: ``weight`` is the row-mask rows of the tensor in
        ``args`` (None without a mask), for ``fn`` to pass on to its pushes
        (``ProbeState._push(..., weight=weight)``); a gradient also comes with
        ``loss_scale=``, the loop's ``context.loss_scale`` as it is delivered."""
        if loss_scale is None:
            fn(*args, weight=weight)
        else:
            fn(*args, weight=weight, loss_scale=loss_scale)

    def grad_callback(self, module: nn.Module, tensor: torch.Tensor) -> Callable | None:
        """The gradient hook for ``tensor``, an output of ``module`` in this forward pass:
        it delivers the gradient to this probe with the row-mask rows of ``tensor`` bound
        now (per-step calls count in forward order). None if the probe failed here."""
        try:
            weight = bound_weight(
                self.context, tensor, module, self.component, id(self), self.channels_first
            )
        except Exception as exc:
            self.fail(exc)
            return None
        return _GradDelivery(self, module, weight)

    # ------------------------------------------------------- plain registration
    def check_plain_call(self, module: nn.Module, first: Any, second: Any) -> None:
        """A call from a torch hook the user registered with this closure directly
        (``PolicyAutoBuilder.attach`` runs :meth:`attach` first, and delivers backward
        probes the gradient with ``grad_input=None``). At the first such call: refuse
        the wrong direction and a component whose measurement needs the hooks
        :meth:`attach` installs before the forward (:meth:`plain_call_gaps`); otherwise
        run :meth:`attach` now, which installs nothing then and resolves what it would
        (layouts, settings), so the metrics are those of the attached probe. Backward
        calls also need what the gradient tap does: no extractor, one output tensor, and
        (checked on every call) no row mask.

        Raises :class:`ProbeError` (outside the probe fault rule: this is a set-up
        mistake, like an unknown component at attach, not a fault of the probe)."""
        if not self.attached:
            if in_backward_pass() != self.backward:
                want = (
                    ("backward", "module.register_full_backward_hook(closure)")
                    if self.backward
                    else ("forward", "module.register_forward_hook(closure)")
                )
                raise ProbeError(
                    f"probe {self.probe!r} on component {self.component!r} is a {want[0]} "
                    f"probe but was registered as a "
                    f"{'forward' if self.backward else 'backward'} hook; register it with "
                    f"{want[1]}, or {self._attach_advice()}"
                )
            gaps = self.plain_call_gaps(module)
            if not gaps:  # attach() now installs nothing and resolves layouts, settings
                late = self.attach(module)
                for handle in late:  # a subclass whose gaps do not say what it hooks
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
        if not (self.backward and first is not None):
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

    def plain_call_gaps(self, module: nn.Module) -> str:
        """What this probe measures through hooks :meth:`attach` installs on submodules
        of ``module`` (empty: nothing, the closure alone sees everything it reports)."""
        return ""

    def _attach_advice(self, capital: bool = False) -> str:
        backward = ", backward=True" if self.backward else ""
        session = "add_training_backward_hook" if self.backward else "add_training_hook"
        return (
            f"{'A' if capital else 'a'}ttach it with policy.attach({self.component!r}, {self.builder_name}, "
            f"context{backward}) (PolicyAutoBuilder; ProbeSession, TrainTool and "
            f"ProbeCallback: {session}({self.component!r}, {self.builder_name}))"
        )

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a torch hook this probe installs besides its component hook) with its
        time added to :attr:`seconds`, which the sampler counts as this probe's cost."""

        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return run

    def fail(self, exc: BaseException) -> None:
        """Disable this probe after ``exc`` and report it once (re-raise when strict)."""
        disable_after_fault(self, exc)

    def tap_grad(
        self,
        output: torch.Tensor,
        weight: torch.Tensor | None,
        compute: Callable[..., None],
    ) -> None:
        """Call ``compute(grad, weight=weight, loss_scale=...)`` (:meth:`call_with`) with
        the gradient of ``output`` (one tensor hook shared by the probes,
        :func:`~policy_probes.grad_tap.on_grad`), ``weight`` being the row-mask rows bound
        in the forward; timed and fault-guarded like the probe's own hook."""
        on_grad(output, self.timed(self.gradient_callback(compute, weight)))

    def gradient_callback(
        self, compute: Callable[..., None], weight: torch.Tensor | None = None
    ) -> Callable[[Any], None]:
        """``grad -> compute(grad, weight=weight, loss_scale=...)`` (:meth:`call_with`),
        skipped once the probe is disabled and fault-guarded like its own hook."""

        def deliver(grad: Any) -> None:
            if not self.enabled:
                return
            try:
                self.call_with(compute, (grad,), weight, self.context.loss_scale)
            except Exception as exc:  # a probe must never take training down
                self.fail(exc)

        return deliver

    def inner_layer_hook(
        self, layer: str, record: Callable[[str, torch.Tensor], None]
    ) -> Callable[[nn.Module, Any, Any], None]:
        """A forward hook for a module inside the component, reported as ``layer``: calls
        ``record(layer, output)`` with the row mask's rows of ``output`` bound, timed and
        fault-guarded like the probe's own hook (tensor outputs only)."""

        def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
            if self.active() and isinstance(output, torch.Tensor):
                self.masked_call(record, (layer, output), output, module, layer)

        return hook

    def masked_call(
        self,
        fn: Callable[..., None],
        args: tuple[Any, ...],
        output: torch.Tensor,
        module: nn.Module | None,
        name: str,
        channels_first: bool = False,
    ) -> None:
        """``fn(*args, weight=rows)`` (:meth:`call_with`) with the row-mask rows of
        ``output`` (the output of the module reported as ``name`` in this forward pass),
        timed and fault-guarded like the probe's own hook."""
        start = time.perf_counter()
        try:
            key = (id(self), name)  # per-step calls count per probe and module
            weight = bound_weight(self.context, output, module, name, key, channels_first)
            self.call_with(fn, args, weight)
        except Exception as exc:  # a probe must never take training down
            self.fail(exc)
        finally:
            self.seconds += time.perf_counter() - start

    # ------------------------------------------------------------- subclasses
    def record(
        self, module: nn.Module, output: torch.Tensor, weight: torch.Tensor | None = None
    ) -> None:
        """Read one forward output; pass ``weight`` (its row-mask rows) to the pushes."""
        raise NotImplementedError

    def record_grad(
        self,
        module: nn.Module,
        grad_output: torch.Tensor,
        weight: torch.Tensor | None = None,
        loss_scale: float | torch.Tensor = 1.0,
    ) -> None:
        """Read one output gradient; pass ``weight`` (its row-mask rows) to the pushes;
        ``loss_scale``: the loop's ``context.loss_scale`` as the gradient arrived."""
        raise NotImplementedError

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Install extra hooks on submodules of the component; return their handles.
        Subclasses that override it set :attr:`attached`."""
        self.attached = True
        return []


class _GradDelivery:
    """``grad -> probe._dispatch(module, None, (grad,), weight)``: what
    :meth:`ProbeHook.grad_callback` returns, as one slotted object instead of a closure
    with three cells (a module called step by step makes one per step, alive until the
    backward)."""

    __slots__ = ("probe", "module", "weight")

    def __init__(self, probe: ProbeHook, module: nn.Module, weight: torch.Tensor | None) -> None:
        self.probe = probe
        self.module = module
        self.weight = weight

    def __call__(self, grad: torch.Tensor) -> None:
        self.probe._dispatch(self.module, None, (grad,), self.weight)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


class GuardedClosure:
    """A plain-function closure from a builder, under the same fault rule as
    :class:`ProbeHook`: if it raises, it is disabled for the rest of the run, reported once
    and counted in ``context.probe_errors`` (unless ``context.strict``)."""

    def __init__(self, hook: Callable, probe: str, component: str, context: ComponentContext):
        self.hook = hook
        self.probe = probe
        self.component = component
        self.context = context
        self.enabled = True

    def __getattr__(self, name: str) -> Any:  # extractor, attach, component_hook, ...
        return getattr(self.hook, name)

    def __call__(self, *args: Any) -> Any:
        if not self.enabled:
            return None
        try:
            return self.hook(*args)
        except Exception as exc:
            disable_after_fault(self, exc)
            return None
