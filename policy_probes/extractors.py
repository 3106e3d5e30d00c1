"""Extractors: how a probe picks the tensor it reads out of a component's output: a
callable ``output -> torch.Tensor``, a key of a mapping or TensorDict (``"hidden"``), a
nested key (``("next", "hidden")``), or a tuple index (``0``). A key or index that does
not match the output raises :class:`ProbeError` from the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch

from policy_probes.outputs import (
    describe_output,
    extractor_example,
    format_keys,
    is_tensordict,
    output_keys,
)
from policy_probes.user_errors import ProbeError

Key: TypeAlias = str | tuple[str, ...]
#: what a builder's ``extractor=`` takes: a callable ``output -> tensor``, a key, a
#: nested key or a tuple index
Extractor: TypeAlias = Callable[[Any], torch.Tensor] | str | tuple[str, ...] | int


class KeyExtractor:
    """Reads ``output[key]`` from a mapping or TensorDict output."""

    def __init__(self, key: Key) -> None:
        self.key = key

    def __call__(self, output: Any) -> Any:
        if not isinstance(output, Mapping):
            raise ProbeError(
                f"extractor={self.key!r} reads a key, but the component returned "
                f"{describe_output(output)}"
            )
        value = _lookup(output, self.key)
        if value is None:
            raise ProbeError(
                f"extractor={self.key!r}: no such key in the component's output; its keys "
                f"are {format_keys(output_keys(output))}"
            )
        return value

    def __repr__(self) -> str:
        return f"KeyExtractor({self.key!r})"


class IndexExtractor:
    """Reads ``output[index]`` from a tuple or list output."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, output: Any) -> Any:
        if not isinstance(output, tuple | list):
            raise ProbeError(
                f"extractor={self.index} reads an index, but the component returned "
                f"{describe_output(output)}"
            )
        if not -len(output) <= self.index < len(output):
            raise ProbeError(
                f"extractor={self.index} is out of range: the component returned "
                f"{describe_output(output)}"
            )
        return output[self.index]

    def __repr__(self) -> str:
        return f"IndexExtractor({self.index})"


def as_extractor(spec: Extractor | None) -> Callable[[Any], Any] | None:
    """The callable for a builder's ``extractor`` argument (``None`` stays ``None``)."""
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):  # True is no index
        return IndexExtractor(spec)
    if isinstance(spec, str) and spec:
        return KeyExtractor(spec)
    if isinstance(spec, tuple) and spec and all(isinstance(k, str) and k for k in spec):
        return KeyExtractor(spec[0] if len(spec) == 1 else spec)
    raise TypeError(
        f'extractor must be a callable output -> tensor, a key (extractor="hidden"), a '
        f'nested key (extractor=("next", "hidden")) or a tuple index (extractor=0); got '
        f"{type(spec).__name__} {spec!r:.60}"
    )


def gradient_target(
    output: Any, extractor: Callable[[Any], Any] | None, component: str, module: Any = None
) -> torch.Tensor:
    """The tensor whose gradient a backward probe on ``component`` reads from ``output``;
    :class:`ProbeError` naming the keys and a fitting ``extractor=`` if it is none."""
    tensor = extractor(output) if extractor is not None else output
    if isinstance(tensor, torch.Tensor):
        return tensor
    via = "its extractor returned" if extractor is not None else "it returned"
    example = "extractor=..." if extractor is not None else extractor_example(output, module)
    raise ProbeError(
        f"backward probe on component {component!r} cannot fire: {via} "
        f"{describe_output(tensor)}, not a tensor. Pass {example} to the builder to pick "
        f"the tensor whose gradient the probe should read."
    )


def _lookup(output: Mapping, key: Key) -> Any:
    """``output[key]`` or ``None`` when absent (nested keys: level by level)."""
    if is_tensordict(output):
        try:
            return output.get(key, None)
        except (KeyError, ValueError, TypeError):  # a nested key through a tensor leaf
            return None
    if key in output:
        return output[key]
    if not isinstance(key, tuple):
        return None
    value: Any = output
    for part in key:
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value
