"""Short descriptions of what a component returned, for error messages: the keys or the
length, never the contents (a TensorDict, recognised without importing it, is read
through ``keys()`` only).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

#: at most this many keys are named; the rest are counted
MAX_KEYS = 6
#: a key's repr longer than this is cut
MAX_KEY_CHARS = 40


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` is a ``tensordict.TensorDictBase`` (without importing tensordict)."""
    module = sys.modules.get("tensordict")
    base = getattr(module, "TensorDictBase", None)
    return base is not None and isinstance(obj, base)


def output_keys(obj: Mapping) -> list[Any]:
    """The keys of a mapping; for a TensorDict its leaf keys, nested ones as tuples
    (``("next", "observation")``), which is what a key extractor takes."""
    if is_tensordict(obj):
        return list(obj.keys(include_nested=True, leaves_only=True))
    return list(obj.keys())


def format_keys(keys: list[Any]) -> str:
    """``['loc', 'scale', ('next', 'h')]``, at most :data:`MAX_KEYS` of them."""
    shown = []
    for key in keys[:MAX_KEYS]:
        text = repr(key)
        shown.append(text if len(text) <= MAX_KEY_CHARS else text[: MAX_KEY_CHARS - 3] + "...")
    more = f" and {len(keys) - MAX_KEYS} more" if len(keys) > MAX_KEYS else ""
    return f"[{', '.join(shown)}]{more}"


def describe_output(obj: Any) -> str:
    """``a TensorDict with keys ['loc', 'scale']``, ``a tuple of 2 items``, ... (short)."""
    if is_tensordict(obj):
        return f"a {type(obj).__name__} with keys {format_keys(output_keys(obj))}"
    if isinstance(obj, Mapping):
        return f"a mapping with keys {format_keys(output_keys(obj))}"
    if isinstance(obj, tuple | list):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"an object of type {type(obj).__name__}"


def extractor_example(obj: Any, module: Any = None) -> str:
    """An ``extractor=`` for error messages: the first of ``module.out_keys`` in ``obj``,
    else the first key (or index) holding a float tensor that requires grad, else the form."""
    if isinstance(obj, Mapping):
        for key in getattr(module, "out_keys", None) or ():
            if isinstance(_get(obj, key), torch.Tensor):
                return _key_literal(key)
        for key in output_keys(obj):
            if _computed(_get(obj, key)):
                return _key_literal(key)
        return 'extractor="<key>"'
    if isinstance(obj, tuple | list):
        for i, item in enumerate(obj):
            if _computed(item):
                return f"extractor={i}"
        return "extractor=<index>"
    return "extractor=lambda out: <the tensor>"


def _get(obj: Mapping, key: Any) -> Any:
    try:
        return obj[key]
    except (KeyError, TypeError, ValueError):
        return None


def _computed(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad


def _key_literal(key: Any) -> str:
    return f'extractor="{key}"' if isinstance(key, str) else f"extractor={key!r}"
