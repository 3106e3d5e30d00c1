"""``key=value`` overrides (``run`` overrides, ``--hook-config`` entries): split at the first
``=``, both sides stripped, the value read by :func:`parse_value`; dotted keys address
nested pydantic models (:func:`check_key`), and :func:`apply_overrides` re-validates.
"""

from __future__ import annotations

import copy
import difflib
import json
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from policy_probes.user_errors import CLIError, one_line

#: Python-style spellings accepted besides JSON's ``true``/``false``/``null``
PYTHON_CONSTANTS: dict[str, Any] = {"True": True, "False": False, "None": None}

M = TypeVar("M", bound=BaseModel)


def parse_value(text: Any) -> Any:
    """A command-line value: JSON first, then Python's ``True``/``False``/``None``, else the
    stripped text; a value that is not a string (given from Python) is returned as it is."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return PYTHON_CONSTANTS.get(text, text)


def split_assignment(
    item: str,
    *,
    what: str = "override",
    shape: str = "key=value",
    example: str = "seed=3",
    error: type[Exception] = CLIError,
) -> tuple[str, Any]:
    """``(key, parsed value)`` of ``"key=value"`` (``error`` without ``=`` or key)."""
    key, sep, raw = str(item).partition("=")
    key = key.strip()
    if not sep or not key:
        raise error(f"{what} {item!r} must look like {shape} (e.g. {example})")
    return key, parse_value(raw)


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = (_model_class(arg) for arg in typing.get_args(annotation))
    return next((cls for cls in found if cls is not None), None)


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Union, types.UnionType):
        return origin is dict or any(_is_mapping(a) for a in typing.get_args(annotation))
    return annotation is dict


def valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key an override may set (``env.kwargs.*`` style for free-form dicts)."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_class(info.annotation)
        if sub is not None:
            out += [key, *valid_keys(sub, key + ".")]
        elif _is_mapping(info.annotation):
            out += [key, key + ".*"]
        else:
            out.append(key)
    extra = getattr(model, "extra_keys", None)  # names a model accepts besides its fields
    out.extend(f"{prefix}{name}" for name in (extra() if extra else ()))
    return out


def check_key(model: type[BaseModel], key: str) -> None:
    """Raise :class:`CLIError` naming the closest valid keys if ``key`` is unknown."""
    current: type[BaseModel] | None = model
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = current.model_fields if current is not None else {}
        extra = getattr(current, "extra_keys", None)
        if part not in fields and extra and part in extra() and i == len(parts) - 1:
            return  # a name the model accepts besides its fields (a sink of your own)
        if part not in fields:
            keys = [k for k in valid_keys(model) if not k.endswith(".*")]
            close = difflib.get_close_matches(key, keys, n=4, cutoff=0.5)
            hint = f" Closest valid keys: {', '.join(close)}." if close else ""
            raise CLIError(f"unknown configuration key {key!r}.{hint} (--dry-run shows all keys)")
        annotation = fields[part].annotation
        if _is_mapping(annotation) and _model_class(annotation) is None:
            return  # free-form dict: any sub-key
        current = _model_class(annotation)
        if current is None and i < len(parts) - 1:
            raise CLIError(
                f"configuration key {'.'.join(parts[: i + 1])!r} has no sub-keys (in {key!r})"
            )


def check_repeated_keys(overrides: Sequence[str]) -> None:
    """Raise :class:`CLIError` when one command line sets a key twice (``seed=1 seed=2``)."""
    seen: dict[str, str] = {}
    for item in overrides:
        key = str(item).partition("=")[0].strip()
        if key in seen:
            raise CLIError(f"{key} is given twice ({seen[key]} and {item}); give each key once")
        seen[key] = str(item)


def apply_overrides(tool: M, overrides: Sequence[str]) -> M:
    """A new, fully re-validated model with ``key=value`` overrides applied (private
    attributes, the probe builders a recipe added, are carried over)."""
    data = tool.model_dump()
    for item in overrides:
        key, value = split_assignment(item)
        check_key(type(tool), key)
        node = data
        *path, leaf = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    try:
        new = type(tool).model_validate(data)
    except ValidationError as exc:
        raise CLIError(f"invalid configuration after overrides: {one_line(exc)}") from None
    private = getattr(tool, "__pydantic_private__", None)
    if private:
        object.__setattr__(new, "__pydantic_private__", copy.copy(private))
    return new
