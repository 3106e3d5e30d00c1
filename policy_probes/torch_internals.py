"""Every use of torch's private API in policy-probes, in one place (pinned by
``tests/test_torch_internals.py``, so a torch upgrade that changes one fails there).
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401 - re-exported
from torch.utils.hooks import RemovableHandle

#: the per-module dicts that hold forward, forward-pre, backward and backward-pre hooks
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = tuple(f"_global{d}" for d in HOOK_DICTS)

#: the start of torch's warning on every backward through a full backward hook on a module
#: none of whose inputs requires grad (a policy's first component)
OUTPUT_ONLY_BACKWARD_WARNING = (
    "Full backward hook is firing when gradients are computed with respect to module outputs"
)


# ------------------------------------------------------------------ module hooks
def child_modules(module: nn.Module) -> list[tuple[str, nn.Module | None]]:
    """``(attribute, child)`` of every direct child, including a child registered under
    several names and ``None`` placeholders (``named_children`` drops both)."""
    return list(module._modules.items())


def module_hooks_installed(module: nn.Module) -> bool:
    """True if any module in ``module``'s subtree has a torch hook (a walk of the child dicts)."""
    stack: list[nn.Module | None] = [module]
    while stack:
        m = stack.pop()
        if m is None:
            continue
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
        stack.extend(m._modules.values())
    return False


def own_parameter_twin(module: nn.Module) -> nn.Module:
    """A childless shallow copy of ``module`` with fresh uninitialised CPU parameters: its
    ``reset_parameters()`` writes the twin, never ``module``."""
    twin = copy.copy(module)  # shallow: the dicts below are replaced before any write
    twin.__dict__["_parameters"] = {
        name: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
        for name, p in module._parameters.items()
    }
    twin.__dict__["_modules"] = {}
    return twin


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """Make ``scheduler.get_last_lr()`` return ``lrs`` (after the param groups' rates were
    set by hand, as a fork re-applies its own learning rate)."""
    scheduler._last_lr = list(lrs)


def module_hook_count(module: nn.Module) -> int:
    """Number of torch hooks of every kind on every module of ``module``'s subtree."""
    return sum(len(getattr(m, d)) for m in module.modules() for d in HOOK_DICTS)


def global_module_hooks_installed() -> bool:
    """True if torch has global module hooks (``register_module_forward_hook``, ...)."""
    return any(getattr(torch_module, d) for d in _GLOBAL_HOOK_DICTS)


@contextmanager
def hooks_set_aside(module: nn.Module) -> Iterator[None]:
    """The module hooks of ``module``'s subtree set aside inside the ``with`` block (a
    re-run the probes must not read), and the same dict objects put back on exit."""
    modules = list(module.modules())
    saved = [[getattr(m, d) for d in HOOK_DICTS] for m in modules]
    for m in modules:
        for d in HOOK_DICTS:
            setattr(m, d, OrderedDict())
    try:
        yield
    finally:
        for m, dicts in zip(modules, saved, strict=True):
            for d, value in zip(HOOK_DICTS, dicts, strict=True):
                setattr(m, d, value)


def init_unbound_handle(handle: RemovableHandle) -> None:
    """Initialise a ``RemovableHandle`` subclass instance that removes nothing from
    torch's dicts itself (it gets a fresh id; its subclass does the removal)."""
    RemovableHandle.__init__(handle, OrderedDict())


@contextmanager
def quiet_output_only_backward_hooks() -> Iterator[None]:
    """Silence :data:`OUTPUT_ONLY_BACKWARD_WARNING` (probes read output gradients)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OUTPUT_ONLY_BACKWARD_WARNING)
        yield


# ------------------------------------------------------------------ torch.compile
def is_compiled_wrapper(module: nn.Module) -> bool:
    """True for what ``torch.compile(module)`` returns (dynamo's ``OptimizedModule``)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def compiled_original(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper runs."""
    return module._orig_mod


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled call ``module.compile()`` installed in place on ``module``, or None."""
    return module.__dict__.get("_compiled_call_impl")


def force_eager_stance() -> Callable[[], None]:
    """Set ``torch.compiler.set_stance("force_eager")`` now; returns the function that
    restores the previous stance (the exit of ``set_stance``'s context manager)."""
    stance = torch.compiler.set_stance("force_eager")
    return lambda: stance.__exit__(None, None, None)


# ------------------------------------------------------------------ tensors and autograd
def version_counter(tensor: torch.Tensor) -> int:
    """The in-place modification counter of ``tensor`` (shared with its views); it
    changes whenever the memory is written in place. Inference tensors have none."""
    return tensor._version


def tensor_slot(tensor: torch.Tensor, name: str) -> Any:
    """The attribute ``name`` :func:`set_tensor_slot` stored on ``tensor``, or None."""
    return tensor.__dict__.get(name)


def set_tensor_slot(tensor: torch.Tensor, name: str, value: Any) -> None:
    """Store ``value`` as the Python attribute ``name`` of ``tensor``."""
    setattr(tensor, name, value)


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current ``backward()`` has finished (call from inside a
    backward hook only: torch refuses outside a backward pass)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward_pass() -> bool:
    """True while autograd runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def is_functorch_wrapped_tensor(tensor: torch.Tensor) -> bool:
    """True for a tensor inside a ``torch.func`` transform (``vmap``'s batched tensors,
    ``grad``'s tracking tensors): a view without storage of its own."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def conv_padding(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> tuple[int, ...]:
    """``F.pad`` padding of a convolution: (last-dim left, last-dim right, ...), as the
    module computes it from ``padding`` (``"same"`` resolved)."""
    return tuple(conv._reversed_padding_repeated_twice)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in ``tree_flatten``'s order: plain tuples, lists and dicts walked
    here (torch's pytree is slower and leaves a reference cycle), anything else by torch."""
    leaves: list[Any] = []
    return leaves if _walk(tree, leaves) is not None else tree_flatten(tree)[0]


def tree_flatten_cached(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten(tree)``, its spec built once per structure of plain containers of
    tensors and scalars (:func:`tree_leaves`); other trees are flattened by torch."""
    leaves: list[Any] = []
    key = _walk(tree, leaves)
    if key is None:
        return tree_flatten(tree)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= 256:  # structures come from a few call sites: bound it anyway
            _SPECS.clear()
        spec = _SPECS[key] = tree_flatten(tree)[1]
    return leaves, spec


_ATOMS = frozenset({int, float, bool, str})
_SPECS: dict[Any, Any] = {}


def _walk(tree: Any, leaves: list[Any]) -> Any:
    """Append ``tree``'s leaves to ``leaves`` and return a hashable key of its structure;
    None when it is not plain containers of tensors and scalars (``leaves`` then unusable)."""
    kind = type(tree)
    if kind is tuple or kind is list or kind is dict:
        keys = tuple(tree) if kind is dict else None
        if keys is not None and not all(type(k) is str for k in keys):
            return None
        parts = []
        for item in tree.values() if kind is dict else tree:
            part = _walk(item, leaves)
            if part is None:
                return None
            parts.append(part)
        return (kind.__name__, keys, tuple(parts))
    if isinstance(tree, torch.Tensor) or tree is None or kind in _ATOMS:
        leaves.append(tree)
        return "*"
    return None
