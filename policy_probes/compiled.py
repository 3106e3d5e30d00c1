"""Probes on policies compiled with ``torch.compile``: observed passes run eagerly.

Dynamo cannot trace what probes do, so while any probe of a policy is armed the
``force_eager`` stance makes compiled code run its Python, where the hooks fire;
unobserved passes run the compiled graph. CUDA graphs are refused. See ``docs/compile.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from policy_probes.torch_internals import (
    compiled_call,
    compiled_original,
    force_eager_stance,
    is_compiled_wrapper,
)
from policy_probes.user_errors import ProbeError

#: ids of the owners (policies) that hold the eager stance now
_holders: set[int] = set()
#: ids of the owners whose garbage collection releases their claim (weakref.finalize)
_watched: set[int] = set()
#: restores the stance that was set before probes set ``force_eager`` (None: not set)
_forced: Any = None


def hold_eager(owner: object, hold: bool) -> None:
    """Take (``hold=True``) or give back ``owner``'s claim on the ``force_eager`` stance;
    the stance is set while at least one owner holds it. Host-side only, idempotent."""
    key = id(owner)
    if hold:
        if key in _holders:
            return
        _holders.add(key)
        if key not in _watched:  # an owner dropped while armed gives its claim back
            _watched.add(key)
            weakref.finalize(owner, _forget, key)
        global _forced
        if _forced is None:
            _forced = force_eager_stance()
    else:
        _release(key)


def _forget(key: int) -> None:
    _watched.discard(key)
    _release(key)


def _release(key: int) -> None:
    global _forced
    if key in _holders:
        _holders.discard(key)
        if not _holders and _forced is not None:
            restore, _forced = _forced, None
            restore()


class _Claim:
    """A holder of the eager stance for one ``with`` block."""


@contextlib.contextmanager
def eager_block() -> Iterator[None]:
    """``force_eager`` for the block, as one more claim on the stance (unlike a nested
    ``set_stance``, its end cannot undo a claim taken inside it, nor the reverse)."""
    claim = _Claim()
    hold_eager(claim, True)
    try:
        yield
    finally:
        hold_eager(claim, False)


def eager_held() -> bool:
    """Whether probes hold the ``force_eager`` stance now."""
    return _forced is not None


def unwrap(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wraps (hooks go there), else ``module``."""
    while is_compiled_wrapper(module):
        module = compiled_original(module)
    return module


def _uses_cuda_graphs(compiled: Any) -> bool:
    """Whether a ``torch.compile`` result (module or function) records CUDA graphs."""
    get = getattr(compiled, "get_compiler_config", None)
    try:
        config = get() if callable(get) else None
    except Exception:  # a backend without a config: no inductor CUDA graphs
        return False
    return bool(isinstance(config, dict) and config.get("triton.cudagraphs"))


def check_compiled(module: nn.Module, *extra: Any) -> None:
    """Refuse probes on a compiled part that uses CUDA graphs: ``torch.compile`` wrappers and
    ``module.compile()`` calls in ``module``'s tree, and ``extra`` compiled functions."""
    tree = module.named_modules()
    parts = [(name, sub if is_compiled_wrapper(sub) else compiled_call(sub)) for name, sub in tree]
    for name, part in [*parts, *(("", fn) for fn in extra)]:
        if _uses_cuda_graphs(part):
            where = f" ({name})" if name else ""
            raise ProbeError(
                f"probes cannot observe a policy compiled with CUDA graphs{where}: "
                f'mode="reduce-overhead" and mode="max-autotune" replay recorded graphs, '
                f"which the probes' eager passes would interleave with. Compile with "
                f'mode="default" or mode="max-autotune-no-cudagraphs" (docs/compile.md)'
            )
