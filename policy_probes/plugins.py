"""Plugins: the probes, remedies and metric sinks a run selects by name (``probes=[...]``,
``remedies=[...]``, ``sinks.<name>=true``). A plugin class says what it is (``kind``,
``name``; a probe also its events, metrics, findings rules, console defaults, docs page)
and registers with :func:`register`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

KINDS = ("probe", "remedy", "sink")
_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}
T = TypeVar("T", bound=type)
log = logging.getLogger("policy_probes")


@dataclass(frozen=True)
class Rule:
    """A findings rule: the per-epoch ``metric`` it reads (a metric of ``probe``, for every
    component and layer it reports; without a probe, one record key of the run) and the
    condition that makes it a finding (docs/findings.md).

    ``tier``: ``"finding"`` for a direct test of what its text claims, ``"observation"``
    for a measure's unusual trend that claims no harm. The rolling median over ``window``
    points is compared with a **trailing baseline**: the median of the ``window`` points
    that end ``lag`` points earlier, never from the run's first ``skip`` points (the
    start of learning). ``kind="level"``: the rolling median is at or beyond
    ``threshold`` (above for ``"rising"``, below for ``"falling"``) and has moved by at
    least ``min_change`` from the baseline that way (``min_change=0``: no baseline, the
    level alone). ``kind="ratio"``: the rolling median over the baseline is at or beyond
    ``threshold`` (2.0 = doubled); a baseline at or below ``floor`` counts as ``floor`` for
    a rising rule and never holds for a falling one (ratios near 0 are noise).
    ``level``: a ratio rule also needs the rolling median at or beyond this level (a jump
    from a low level to a still ordinary one is no finding). ``release``: once the rule
    holds, it keeps holding while the condition is met at this threshold instead of
    ``threshold`` (a measure that settles just below its trigger does not flicker). ``divide_by``: a record key
    the series is divided by epoch by epoch (an update ratio per unit of learning rate
    reads an annealed rate as no change)."""

    name: str
    title: str
    metric: str
    direction: Literal["rising", "falling"]
    kind: Literal["level", "ratio"]
    threshold: float
    threshold_source: str
    docs: str
    remedies: tuple[str, ...]
    meaning: str
    min_change: float = 0.0
    floor: float = 0.0
    tier: Literal["finding", "observation"] = "observation"
    #: points of the rolling median (None: the engine's window)
    window: int | None = None
    #: points from the end of the baseline window to the last point (None: 3 windows)
    lag: int | None = None
    divide_by: str | None = None
    level: float | None = None
    #: the series' first points that never make a baseline (None: the engine's)
    skip: int | None = None
    release: float | None = None
    #: the probe whose metric this is (set when the probe registers)
    probe: str | None = None

    @property
    def pattern(self) -> re.Pattern[str]:
        """The record keys the rule reads; group ``component`` names the component."""
        if self.probe is None:
            return re.compile(re.escape(self.metric))
        return re.compile(
            rf"probes/{re.escape(self.probe)}/(?P<component>[^/]+)/{re.escape(self.metric)}"
        )

    def matches(self, key: str) -> str | None:
        """The component (a run-level rule: the key) when this rule reads ``key``, else None."""
        m = self.pattern.fullmatch(key)
        return None if m is None else m.groupdict().get("component") or key

    @property
    def needs_baseline(self) -> bool:
        return self.kind == "ratio" or self.min_change > 0

    def holds(self, value: float, baseline: float | None, *, held: bool = False) -> bool:
        """Whether ``value`` (a rolling median) meets the condition against ``baseline``
        (None for a level rule without ``min_change``); ``held``: the rule holds already,
        so its ``release`` threshold applies."""
        rising = self.direction == "rising"
        threshold = self.release if held and self.release is not None else self.threshold
        if self.kind == "level":
            if not (value >= threshold if rising else value <= threshold):
                return False
            if not self.needs_baseline:
                return True
            assert baseline is not None
            change = value - baseline if rising else baseline - value
            return change >= self.min_change
        assert baseline is not None
        if self.level is not None and not (value >= self.level if rising else value <= self.level):
            return False
        if baseline <= self.floor:  # too small to divide by (ratio rules read sizes >= 0)
            return rising and self.floor > 0 and value >= threshold * self.floor
        ratio = value / baseline
        return ratio >= threshold if rising else ratio <= threshold


def register(cls: T) -> T:
    """Class decorator: register a plugin under its ``kind`` and ``name`` (a probe's
    rules are bound to it here). Another class under a taken name is refused."""
    kind, name = getattr(cls, "kind", None), getattr(cls, "name", None)
    if kind not in KINDS:
        raise ValueError(f"{cls.__name__}.kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][\w-]*", name):
        raise ValueError(f"{cls.__name__}.name must be an identifier, got {name!r}")
    taken = _REGISTRY[kind].get(name)
    if taken is not None and taken is not cls:
        raise ValueError(f"a {kind} named {name!r} is already registered ({taken.__name__})")
    if kind == "probe":  # a probe's rules read its own metrics
        cls.rules = tuple(replace(r, probe=name) if r.probe is None else r for r in cls.rules)
    _REGISTRY[kind][name] = cls
    return cls


def unregister(kind: str, name: str) -> None:
    """Forget a plugin (tests that declare their own)."""
    _REGISTRY[kind].pop(name, None)


def registered(kind: str) -> dict[str, type]:
    """The plugins of ``kind`` by name, in registration order."""
    return dict(_REGISTRY[kind])


def get(kind: str, name: str) -> type:
    """The plugin ``name`` of ``kind``; a ``ValueError`` listing the registered ones."""
    found = _REGISTRY[kind].get(name)
    if found is None:
        known = list(_REGISTRY[kind])
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown {kind} {name!r}.{hint} Registered: {', '.join(known)}")
    return found


def own_modules() -> list[str]:
    """The modules outside this package that registered plugins (``plugin_modules``)."""
    modules = {cls.__module__ for plugins in _REGISTRY.values() for cls in plugins.values()}
    return sorted(m for m in modules if not m.startswith("policy_probes.") and m != "__main__")


def import_modules(names: Any) -> None:
    """Import the modules a run recorded (:func:`own_modules`); one that fails is named
    in a warning (its rules are then not applied)."""
    for name in names if isinstance(names, list) else ():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure leaves its rules out
            log.warning(
                "the run's plugins in module %r could not be imported (%s: %s), so their "
                "findings rules are not applied; run from where that module is importable",
                name,
                type(exc).__name__,
                exc,
            )


def findings_rules() -> tuple[Rule, ...]:
    """Every registered probe's findings rules, in registration order."""
    return tuple(rule for cls in _REGISTRY["probe"].values() for rule in cls.rules)


def console_metrics() -> tuple[str, ...]:
    """The registered probes' console patterns (``probes/<probe>/*/<metric>``)."""
    return tuple(key for cls in _REGISTRY["probe"].values() for key in _console_keys(cls))


def _console_keys(cls: type) -> list[str]:
    return [f"probes/{cls.name}/*/{metric}" for metric in cls.console]


#: arguments whose values are lists, written with ``|`` between items
LIST_KEYS = ("layers", "consumer", "taus")


def parse_spec(spec: str, kind: str) -> tuple[str, str, dict[str, Any]]:
    """``"name@component[:key=value,...]"`` -> ``(name, component, arguments)`` for a
    registered plugin of ``kind`` (a ``ValueError`` says what is wrong). Values are
    integers, floats, ``true``/``false``/``none`` or text; list items are separated by
    ``|`` (``layers=layer_1.linear|layer_0.linear``)."""
    if not isinstance(spec, str):
        raise ValueError(
            f"a {kind} spec is a string 'name@component[:key=value,...]', got {spec!r}"
        )
    head, _, args = spec.strip().partition(":")
    name, at, component = (part.strip() for part in head.partition("@"))
    if not at or not name or not component:
        raise ValueError(
            f"{kind} spec {spec!r}: write 'name@component[:key=value,...]', e.g. "
            f"'{'redo@critic_mlp:tau=0.025' if kind == 'remedy' else 'relu@actor_mlp:tau=0.1'}'"
        )
    try:
        get(kind, name)
    except ValueError as exc:
        raise ValueError(f"{kind} spec {spec!r}: {exc}") from None
    kwargs: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(f"{kind} spec {spec!r}: {item!r} is not key=value")
        if key in kwargs:
            raise ValueError(f"{kind} spec {spec!r}: {key} is given twice; give each key once")
        kwargs[key] = _value(key, text)
    return name, component, kwargs


def from_spec(spec: str, kind: str) -> tuple[str, Any, dict[str, Any]]:
    """``"name@component[:key=value,...]"`` -> ``(component, plugin, rest)``: the plugin built
    from the arguments it takes (``spec_keys`` too), ``rest`` a probe's placement arguments."""
    name, component, kwargs = parse_spec(spec, kind)
    cls = get(kind, name)
    params = inspect.signature(cls).parameters.values()
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        known += list(getattr(cls, "spec_keys", ()))
    rest = list(getattr(cls, "placements", ())) if kind == "probe" else []
    for key in kwargs:
        if key not in known and key not in rest:
            raise ValueError(
                f"{kind} spec {spec!r}: {key!r} is no key of {name}; keys: {known + rest}"
            )
    try:
        made = cls(**{k: v for k, v in kwargs.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{kind} spec {spec!r}: {exc}") from None
    return component, made, {k: v for k, v in kwargs.items() if k not in known}


def _value(key: str, text: str) -> Any:
    if key in LIST_KEYS:
        return [_value("", item.strip()) for item in text.split("|") if item.strip()]
    constants = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in constants:
        return constants[text.lower()]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def split_specs(value: Any, kind: str) -> list[str]:
    """A list of specs, a JSON list, or one string of specs separated by ``;``."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("["):
            return [s.strip() for s in text.split(";") if s.strip()]
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{kind} specs {text!r} are not a JSON list: {exc}") from None
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
        raise ValueError(
            f"{kind} specs must be a list of 'name@component[:key=value,...]' strings, "
            f"got {value!r}"
        )
    return [s.strip() for s in value if s.strip()]


def info(cls: type) -> dict[str, Any]:
    """What a plugin declares, as plain values (``policy-probes plugins``)."""
    paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
    out: dict[str, Any] = {"summary": " ".join(paragraph.split())}
    if getattr(cls, "kind", None) == "probe":
        out.update(
            direction=cls.direction,
            events=list(cls.events),
            placements=list(cls.placements),
            metrics=dict(cls.metrics),
            findings=[rule.name for rule in cls.rules],
            console=_console_keys(cls),
        )
    out["docs"] = getattr(cls, "docs", "")
    return out
