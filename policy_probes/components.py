"""PolicyAutoBuilder: a policy made of named components that probes can attach to.

Names are addressable at every depth (``actor_mlp``, ``actor_mlp.layer_0.linear``).
Patterns may use globs: ``*`` matches within one dotted level (``actor_mlp.*`` selects
``actor_mlp.layer_0`` but not ``actor_mlp.layer_0.linear``), ``**`` crosses levels, ``?``
and ``[...]`` work as in :mod:`fnmatch`.
"""

from __future__ import annotations

import difflib
import inspect
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.compiled import check_compiled, eager_block, hold_eager, unwrap
from policy_probes.context import ComponentContext
from policy_probes.layers import LinearSpec, MLPSpec, build_component, check_spec_memory
from policy_probes.outputs import describe_output, extractor_example
from policy_probes.probes.observation import Observation, grad_tap
from policy_probes.probes.probe import Probe, ProbeBuilder, placement_of
from policy_probes.recurrent import default_extractor
from policy_probes.torch_internals import init_unbound_handle, module_hooks_installed, tree_leaves
from policy_probes.user_errors import ProbeError

GLOB_CHARS = set("*?[")


class ProbeHandle(RemovableHandle):
    """A ``RemovableHandle`` for everything one registration installed; :meth:`sync`
    installs it while the probe records in the current phase and pass, removes it otherwise."""

    def __init__(
        self,
        handles: Iterable[RemovableHandle],
        component: str,
        install: Callable[[], list[RemovableHandle]] | None = None,
        hook: Any = None,
    ) -> None:
        init_unbound_handle(self)  # gives the handle an id; removal is ours
        self.handles = list(handles)
        self.component = component
        self.hook = hook
        self._install = install
        #: the policy that keeps this handle (told when it is removed, see _hold_eager)
        self.owner: PolicyAutoBuilder | None = None

    @property
    def armed(self) -> bool:
        return bool(self.handles)

    def wanted(self) -> bool:
        """Whether the probe records in its context's current phase."""
        hook = self.hook
        if hook is None:
            return True
        if not hook.enabled or (hook.phases is not None and hook.context.phase not in hook.phases):
            return False
        sampler = getattr(hook.context, "sampler", None)  # which passes it observes
        return sampler is None or sampler.observes(self)

    def sync(self) -> None:
        """Install or remove the torch hooks to match :meth:`wanted`."""
        if self._install is None:
            return
        if self.wanted():
            if not self.handles:
                self.handles = self._install()
        elif self.handles:
            self._disarm()

    def _disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def remove(self) -> None:
        self._install = None
        self._disarm()
        if self.owner is not None:
            self.owner._release(self)


_GLOB_TOKENS = re.compile(r"\*\*|\*|\?|\[[^]]*]|.", re.S)
_GLOB_REGEX = {"**": ".*", "*": r"[^.]*", "?": r"[^.]"}


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    out = []
    for token in _GLOB_TOKENS.findall(pattern):
        if token in _GLOB_REGEX:
            out.append(_GLOB_REGEX[token])
        elif len(token) > 1:  # a [...] class; [!...] negates as in fnmatch
            body = token[1:-1]
            out.append(f"[^{body[1:]}]" if body.startswith("!") else f"[{body}]")
        else:
            out.append(re.escape(token))
    return re.compile("".join(out) + r"\Z")


def output_kind(output: Any) -> str:
    kinds = (("tensor", torch.Tensor), ("mapping", Mapping), ("sequence", tuple | list))
    return next((kind for kind, types in kinds if isinstance(output, types)), "object")


class PolicyAutoBuilder(nn.Module):
    """An ``nn.Module`` whose named parts can be probed: built from a component spec (name ->
    ``nn.Module`` or a :class:`~policy_probes.layers.MLPSpec`...) with your ``forward``, or
    any module made probe-able by :meth:`wrap`."""

    def __init__(self, spec: Mapping[str, nn.Module | MLPSpec | LinearSpec] | None = None) -> None:
        super().__init__()
        self._component_modules: OrderedDict[str, nn.Module] = OrderedDict()
        self._output_kinds: dict[str, str] = {}
        # name -> (short description, extractor example) of traced non-tensor outputs
        self._output_notes: dict[str, tuple[str, str]] = {}
        self._handles: list[ProbeHandle] = []
        self._contexts: list[ComponentContext] = []
        check_spec_memory(spec or {})  # before any part is allocated
        for name, part in (spec or {}).items():
            module = build_component(name, part)
            if "." in name or not name:
                raise ValueError(f"component names must be non-empty and dot-free, got {name!r}")
            self.add_module(name, module)
            self._component_modules[name] = module

    @classmethod
    def wrap(
        cls,
        module: nn.Module,
        components: Mapping[str, nn.Module | str] | None = None,
        example_inputs: tuple[Any, ...] | None = None,
    ) -> PolicyAutoBuilder:
        """Make an existing module probe-able without changing it: ``components`` maps names to
        submodules or paths (``None``: its children); ``example_inputs``: :meth:`trace_outputs`."""
        inner = unwrap(module)  # torch.compile(module): hooks go on the module it runs
        if inner is not module and isinstance(inner, PolicyAutoBuilder) and components is None:
            if example_inputs is not None:
                inner.trace_outputs(*example_inputs)
            return inner  # a compiled PolicyAutoBuilder: its own components
        module = inner
        wrapper = cls()
        wrapper.module = module
        if components is None:
            components = dict(module.named_children()) or {type(module).__name__.lower(): module}
        owned = {id(m) for m in module.modules()}
        for name, target in components.items():
            if isinstance(target, str):
                try:
                    target = module.get_submodule(target)
                except AttributeError:
                    names = [n for n, _ in module.named_modules() if n]
                    raise KeyError(
                        f"{type(module).__name__} has no submodule {target!r} (for component "
                        f"{name!r}); its submodules are {names}"
                    ) from None
            if not isinstance(target, nn.Module) or id(target) not in owned:
                raise TypeError(f"component {name!r} must be a submodule of the wrapped module")
            if "." in name or not name:
                raise ValueError(f"component names must be non-empty and dot-free, got {name!r}")
            wrapper._component_modules[name] = target
        if example_inputs is not None:
            wrapper.trace_outputs(*example_inputs)
        return wrapper

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._modules.get("module")
        if inner is None:
            raise NotImplementedError(f"{type(self).__name__} must define forward()")
        return inner(*args, **kwargs)

    @property
    def components(self) -> OrderedDict[str, nn.Module]:
        return OrderedDict(self._component_modules)

    def component_names(self) -> list[str]:
        """Every addressable name: components and their submodules at all depths."""
        names: list[str] = []
        for name, module in self._component_modules.items():
            names.append(name)
            names.extend(f"{name}.{sub}" for sub, _ in module.named_modules() if sub)
        return names

    def get_component(self, name: str) -> nn.Module:
        top, _, rest = name.partition(".")
        module = self._component_modules.get(top)
        if module is not None:
            try:
                return module.get_submodule(rest)  # "" is the component itself
            except AttributeError:
                pass
        raise KeyError(self._unknown_message(name))

    def resolve(self, pattern: str) -> list[str]:
        """Names matched by a name or glob; a pattern that matches nothing is a KeyError."""
        if not GLOB_CHARS & set(pattern):
            self.get_component(pattern)
            return [pattern]
        regex = glob_to_regex(pattern)
        matched = [n for n in self.component_names() if regex.match(n)]
        if not matched:
            raise KeyError(self._unknown_message(pattern, glob=True))
        return matched

    def _unknown_message(self, name: str, glob: bool = False) -> str:
        names = self.component_names()
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        what = "glob pattern" if glob else "component"
        hint = f" Closest: {', '.join(close)}." if close else ""
        return f"unknown {what} {name!r}.{hint} Available components: {', '.join(names)}"

    @torch.no_grad()
    def trace_outputs(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        """Run one forward pass and record what every addressable part returns, in eval
        mode with forked RNG states (the model and random streams stay as they were)."""
        kinds: dict[str, str] = {}
        notes: dict[str, tuple[str, str]] = {}
        handles = []
        for name in self.component_names():

            def hook(m: nn.Module, _i: Any, out: Any, name: str = name) -> None:
                if kinds.setdefault(name, output_kind(out)) != "tensor":
                    notes.setdefault(name, (describe_output(out), extractor_example(out, m)))

            handles.append(self.get_component(name).register_forward_hook(hook))
        modes = {m: m.training for m in self.modules()}
        # the generators of the CUDA devices the pass can draw on: the model's and inputs'
        tensors = [*self.parameters(), *self.buffers(), *tree_leaves((args, kwargs))]
        on_cuda = (t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda")
        cuda = sorted({t.device.index or 0 for t in on_cuda})
        try:
            # compiled parts run their Python code: the tracing hooks fire, nothing compiles
            with torch.random.fork_rng(devices=cuda), eager_block():
                self.eval()(*args, **kwargs)
        finally:
            for m, mode in modes.items():
                m.training = mode
            for h in handles:
                h.remove()
        self._output_kinds.update(kinds)
        self._output_notes.update(notes)
        return kinds

    def output_kind(self, name: str) -> str:
        """``tensor``, ``mapping``, ``sequence``, ``object`` or ``unknown`` (not traced)."""
        return self._output_kinds.get(name, "unknown")

    def register_component_hook_rule(
        self, *, component_name: str, hook: Observation
    ) -> ProbeHandle:
        """Install ``hook`` as a forward hook on one component, with its probe's hooks in it."""
        module = self.get_component(component_name)

        def install() -> list[RemovableHandle]:
            own = [module.register_forward_hook(hook)] if hook.component_hook else []
            return [*own, *hook.attach(module)]

        return self._keep(ProbeHandle(install(), component_name, install, hook))

    def register_component_backward_hook_rule(
        self, *, component_name: str, hook: Observation
    ) -> ProbeHandle:
        """Install ``hook`` to receive the gradient of one component's output: a plain
        closure on a tensor-returning component through ``register_full_backward_hook``,
        anything else through a tensor hook a forward hook registers. A non-tensor output
        needs the placement's ``extractor``: :class:`ProbeError` when attached if the
        output type is known (:meth:`trace_outputs`), else at the first forward."""
        module = self.get_component(component_name)
        _check_inplace(module, component_name)
        # the recurrent default applies only when the placement gives no extractor
        extractor = hook.extractor or default_extractor(module)
        kind = self.output_kind(component_name)
        if kind in ("mapping", "sequence", "object") and extractor is None:
            seen, example = self._output_notes.get(component_name, (kind, "extractor=..."))
            raise ProbeError(
                f"backward probe on component {component_name!r} cannot fire: the component "
                f"returns a {kind}, not a tensor ({seen}). Pass {example} where it is "
                f"attached to pick the tensor."
            )

        def install() -> list[RemovableHandle]:
            if not hook.component_hook:
                handles = []  # the probe measures through the hooks its attach() installs
            elif kind == "tensor" and extractor is None and hook.closure is not None:
                handles = [module.register_full_backward_hook(hook)]
            else:
                handles = [module.register_forward_hook(grad_tap(hook, extractor))]
            return handles + hook.attach(module)

        return self._keep(ProbeHandle(install(), component_name, install, hook))

    def attach(
        self,
        pattern: str,
        builder: ProbeBuilder,
        context: ComponentContext,
        *,
        backward: bool | None = None,
        **placement: Any,
    ) -> list[ProbeHandle]:
        """Attach ``builder`` (a :class:`~policy_probes.probes.probe.Probe`, or a plain
        ``(component, context) -> hook closure | None``) to each name ``pattern`` resolves
        to. ``backward``: for closures (forward unless True); for a probe, when given, it
        must agree with its direction. ``placement``: see ``Placement``."""
        check_builder(builder, pattern)
        check_compiled(self)
        place = placement_of(builder, **placement)
        probe = builder if isinstance(builder, Probe) else None
        if probe is not None and backward is not None and backward != probe.backward:
            raise TypeError(
                f"the {probe.name!r} probe is a {probe.direction} probe; attach it to "
                f"{pattern!r} with add_training_hook, which places every probe by its "
                f"direction"
            )
        out = []
        for name in self.resolve(pattern):
            if probe is not None:
                hook = probe(name, context, place)
            else:
                closure = builder(name, context)
                if closure is not None and not callable(closure):
                    raise TypeError(
                        f"builder {getattr(builder, '__name__', builder)!r} returned "
                        f"{describe_output(closure)} for component {name!r}; a builder must "
                        f"return a callable hook or None"
                    )
                label = getattr(builder, "__name__", "hook")
                hook = closure and Observation(None, name, context, place, closure, label)
                if hook is not None:
                    hook.backward = bool(backward)
            if hook is None:
                continue
            hook.locate = self.get_component
            rule = self.register_component_hook_rule
            if hook.backward:
                rule = self.register_component_backward_hook_rule
            try:
                out.append(rule(component_name=name, hook=hook))
            except Exception:  # forget it, so a corrected builder can be attached here
                if hook.tracker is not None:
                    hook.tracker.unregister_component(name)
                raise
        return out

    def _keep(self, handle: ProbeHandle) -> ProbeHandle:
        self._handles.append(handle)
        handle.owner = self
        context = getattr(handle.hook, "context", None)
        if isinstance(context, ComponentContext):
            context.add_phase_listener(self._sync_handles)
            if context not in self._contexts:
                self._contexts.append(context)
        handle.sync()  # a probe that does not record in the current phase starts unarmed
        self._hold_eager()
        return handle

    def _sync_handles(self, _phase: str) -> None:
        start = time.perf_counter()
        for handle in self._handles:
            handle.sync()
        self._hold_eager()
        for context in self._contexts:  # installing hooks is the probes' cost too
            if getattr(context, "sampler", None) is not None:
                context.sampler.sync_seconds += time.perf_counter() - start
                break

    def _release(self, handle: ProbeHandle) -> None:
        if handle in self._handles:
            self._handles.remove(handle)
        self._hold_eager()

    def _hold_eager(self) -> None:
        """Compiled code runs eagerly while a probe is armed or lifecycle hooks run."""
        lifecycle = any(c.phase == "hook" for c in self._contexts)
        hold_eager(self, lifecycle or any(h.armed for h in self._handles))

    @property
    def hook_handles(self) -> list[ProbeHandle]:
        """Handles of registrations that are still in place (armed or not)."""
        return list(self._handles)

    def hooks_installed(self) -> bool:
        """True if any torch hook is installed on any module of this policy."""
        return module_hooks_installed(self)

    def remove_hooks(self) -> None:
        """Remove every hook registered through this builder."""
        while self._handles:
            self._handles.pop().remove()
        hold_eager(self, False)
        for context in self._contexts:
            context.remove_phase_listener(self._sync_handles)
        self._contexts.clear()


#: a probe a driver holds until it attaches it: (pattern, builder, backward, placement),
#: where ``backward`` is None for "by the probe's own direction" (``add_training_hook``)
ProbeSpec = tuple[str, ProbeBuilder, "bool | None", dict[str, Any]]


def add_probe(
    probes: list[ProbeSpec],
    pattern: str,
    builder: ProbeBuilder,
    backward: bool | None,
    placement: dict[str, Any],
) -> None:
    """Check a probe a driver is given (pattern, builder, placement, not the same builder
    on the same pattern twice) and add it to ``probes``."""
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"component pattern must be a non-empty string, got {pattern!r}")
    check_builder(builder, pattern)
    placement_of(builder, **placement)  # a wrong placement fails where it was written
    if any(p == pattern and b is builder for p, b, _, _ in probes):
        raise ValueError(
            f"this builder is already attached to {pattern!r}; create a new builder to "
            f"attach the same probe twice"
        )
    probes.append((pattern, builder, backward, dict(placement)))


def check_builder(builder: Any, pattern: str) -> None:
    """A builder must be a probe or callable as ``(component_name, context)``."""
    if isinstance(builder, Probe):
        return
    if isinstance(builder, type) and issubclass(builder, Probe):
        raise TypeError(
            f"{builder.__name__} for {pattern!r} is a probe class; attach an instance, "
            f"e.g. {builder.__name__}()"
        )
    if not callable(builder):
        raise TypeError(
            f"hook builder for {pattern!r} must be callable (component_name, context) -> "
            f"hook | None, got {describe_output(builder)}; did you forget the parentheses, "
            f"e.g. attach_relu_activation_hooks()?"
        )
    try:
        inspect.signature(builder).bind("component", ComponentContext())
    except TypeError:
        name = getattr(builder, "__name__", type(builder).__name__)
        raise TypeError(
            f"hook builder {name!r} for {pattern!r} must be callable as (component_name, "
            f"context) -> hook | None; did you forget the parentheses, e.g. {name}()?"
        ) from None
    except ValueError:  # builtins without a signature: let the call decide
        pass


#: torch modules whose ``inplace=True`` overwrites their input, the activation a backward
#: probe reads (``inplace`` on other modules, a TensorDictModule's, says nothing of that)
INPLACE_OVERWRITING = (
    *(nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.RReLU, nn.ELU, nn.CELU, nn.SELU, nn.SiLU, nn.Mish),
    *(nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Threshold),
    *(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d),
    *(nn.AlphaDropout, nn.FeatureAlphaDropout),
)


def _check_inplace(module: nn.Module, name: str) -> None:
    for sub_name, sub in module.named_modules():
        if isinstance(sub, INPLACE_OVERWRITING) and sub.inplace is True:
            where = f"{name}.{sub_name}" if sub_name else name
            raise ProbeError(
                f"backward probe on component {name!r}: {where} is {type(sub).__name__}"
                f"(inplace=True); in-place activations overwrite the tensors a backward probe "
                f"reads. Build it with inplace=False."
            )
