"""Remedies written as text, for configuration fields and ``key=value`` overrides.

A spec is ``name@component[:key=value,...]``, e.g. ``"redo@critic_mlp:tau=0.025,
every_epochs=25"``. Values are read as integers, floats, ``true``/``false``/``none``, or
text; a list (``layers``, ``consumer``) separates its items with ``|``
(``reset_layers@critic_mlp:layers=layer_1.linear|layer_0.linear,every_epochs=10``).
Several specs: a list, a JSON list, or one string separated by ``;``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from policy_probes.remedies.base import Remedy, RemedyOptions
from policy_probes.remedies.continual_backprop import continual_backprop
from policy_probes.remedies.dormant_recycling import redo
from policy_probes.remedies.l2_init import l2_init
from policy_probes.remedies.layer_reset import reset_layers
from policy_probes.remedies.plasticity_injection import plasticity_injection
from policy_probes.remedies.shrink_perturb import shrink_and_perturb
from policy_probes.remedies.soft_shrink_perturb import soft_shrink_perturb

#: remedy name -> factory
REMEDIES: dict[str, Callable[..., Remedy]] = {
    "redo": redo,
    "shrink_and_perturb": shrink_and_perturb,
    "reset_layers": reset_layers,
    "l2_init": l2_init,
    "continual_backprop": continual_backprop,
    "soft_shrink_perturb": soft_shrink_perturb,
    "plasticity_injection": plasticity_injection,
}
#: the arguments that take lists
LIST_KEYS = ("layers", "consumer")


def _value(key: str, text: str) -> Any:
    text = text.strip()
    if key in LIST_KEYS:
        return [item.strip() for item in text.split("|") if item.strip()]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_remedy_spec(spec: str) -> tuple[str, Remedy]:
    """``"redo@critic_mlp:tau=0.025,every_epochs=25"`` -> ``("critic_mlp", redo(...))``;
    a ``ValueError`` says what is wrong (unknown remedy or key, bad value)."""
    if not isinstance(spec, str):
        raise ValueError(
            f"a remedy spec is a string 'name@component[:key=value,...]', got {spec!r}"
        )
    head, _, args = spec.strip().partition(":")
    name, at, component = head.partition("@")
    name, component = name.strip(), component.strip()
    if not at or not name or not component:
        raise ValueError(
            f"remedy spec {spec!r}: write 'name@component[:key=value,...]', e.g. "
            f"'redo@critic_mlp:tau=0.025,every_epochs=25'"
        )
    factory = REMEDIES.get(name)
    if factory is None:
        raise ValueError(
            f"remedy spec {spec!r}: unknown remedy {name!r}; known: {sorted(REMEDIES)}"
        )
    params = inspect.signature(factory).parameters.values()
    known = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
    if len(known) < len(params):  # **options: passed on to Remedy
        known += list(RemedyOptions.__annotations__)
    kwargs: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in known:
            raise ValueError(
                f"remedy spec {spec!r}: {item!r} is not key=value with a key of {name}; keys: "
                f"{known}"
            )
        if key in kwargs:
            raise ValueError(f"remedy spec {spec!r}: {key} is given twice; give each key once")
        kwargs[key] = _value(key, text)
    try:
        return component, factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"remedy spec {spec!r}: {exc}") from None


def split_remedy_specs(value: Any) -> list[str]:
    """A list of specs, a JSON list, or one string of specs separated by ``;``."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"remedies={text!r} is not a JSON list: {exc}") from None
        else:
            return [s.strip() for s in text.split(";") if s.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise ValueError(
            f"remedies must be a list of 'name@component[:key=value,...]' strings, got {value!r}"
        )
    return [s.strip() for s in value if s.strip()]
