"""HookRegistry and hook selection: names, groups and per-hook configuration.

Groups: ``none``, ``minimal`` (training_metrics, norms), ``observers``, ``interventions``
(without debug ones), ``full`` (both); keywords ``all`` (= full) and ``with_debug`` (full
and the debug interventions). ``training_metrics`` joins any non-empty selection."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from policy_probes.lifecycle.points import HookPoint
from policy_probes.overrides import split_assignment

if TYPE_CHECKING:
    from policy_probes.lifecycle.hook import TrainingHook

GROUPS: tuple[str, ...] = ("none", "minimal", "observers", "interventions", "full")
KEYWORDS: tuple[str, ...] = ("all", "observers", "with_debug")


class HookSelectionError(ValueError):
    """A hook name, group or configuration entry that does not exist or does not fit."""


def _suggest(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


class HookRegistry:
    """Stores hook classes by name; instances are made only when a hook is selected."""

    _hooks: dict[str, type[TrainingHook]] = {}
    _builtins_registered = False

    @classmethod
    def _registered(cls) -> dict[str, type[TrainingHook]]:
        """:attr:`_hooks`, once the built-in hooks are registered (``BUILTIN_HOOKS`` of
        :mod:`policy_probes.lifecycle.hooks`; their modules import torch, so they are
        imported at the first lookup, not with the package)."""
        if not cls._builtins_registered:
            cls._builtins_registered = True
            from policy_probes.lifecycle.hooks import BUILTIN_HOOKS

            for hook_cls in BUILTIN_HOOKS:
                cls.register(hook_cls)
        return cls._hooks

    @classmethod
    def register(cls, hook_cls: type[TrainingHook]) -> type[TrainingHook]:
        """Class decorator: validate the declarations and store the class."""
        from policy_probes.lifecycle.hook import COST_CLASSES, InterventionHook

        name = hook_cls.name
        if not name or "/" in name or "." in name or name in GROUPS + KEYWORDS:
            raise ValueError(
                f"{hook_cls.__name__}.name must be a non-empty identifier without '/' or '.' "
                f"and not a group name, got {name!r}"
            )
        if name in cls._hooks and cls._hooks[name] is not hook_cls:
            raise ValueError(
                f"a hook named {name!r} is already registered ({cls._hooks[name].__name__})"
            )
        if hook_cls.cost not in COST_CLASSES:
            raise ValueError(
                f"hook {name!r}: cost must be one of {COST_CLASSES}, got {hook_cls.cost!r}"
            )
        if not hook_cls.hook_points:
            raise ValueError(f"hook {name!r} declares no hook_points")
        for p in hook_cls.hook_points:
            HookPoint.parse(p)
        if issubclass(hook_cls, InterventionHook) and hook_cls.intervention_points is not None:
            stray = set(hook_cls.intervention_points) - set(hook_cls.hook_points)
            if stray:
                raise ValueError(
                    f"hook {name!r}: intervention_points {sorted(p.name for p in stray)} are not "
                    f"among its hook_points"
                )
        cls._hooks[name] = hook_cls
        return hook_cls

    @classmethod
    def unregister(cls, name: str) -> None:
        cls._hooks.pop(name, None)

    @classmethod
    def names(cls) -> list[str]:
        """Registered names in dispatch order (``order``, then registration order)."""
        return [c.name for c in cls.classes()]

    @classmethod
    def get(cls, name: str) -> type[TrainingHook]:
        try:
            return cls._registered()[name]
        except KeyError:
            raise HookSelectionError(
                f"unknown hook {name!r}.{_suggest(name, cls._registered())} Registered hooks: "
                f"{', '.join(c.name for c in cls.classes())}; groups: {', '.join(GROUPS)}; keywords: "
                f"{', '.join(KEYWORDS)}"
            ) from None

    @classmethod
    def classes(cls) -> list[type[TrainingHook]]:
        return sorted(
            cls._registered().values(), key=lambda c: c.order
        )  # stable: ties keep registration

    @classmethod
    def expand(cls, group: str) -> list[str]:
        """Hook names of a group or keyword (registration order)."""
        from policy_probes.lifecycle.hook import InterventionHook

        hooks = cls.classes()
        observers = [h.name for h in hooks if not issubclass(h, InterventionHook)]
        interventions = [h.name for h in hooks if issubclass(h, InterventionHook) and not h.debug]
        debug = [h.name for h in hooks if h.debug]
        table = {
            "none": [],
            "minimal": [h.name for h in hooks if "minimal" in h.groups],
            "observers": observers,
            "interventions": interventions,
            "full": observers + interventions,
            "all": observers + interventions,
            "with_debug": observers + interventions + debug,
        }
        try:
            return table[group]
        except KeyError:
            raise HookSelectionError(
                f"unknown hook group {group!r}.{_suggest(group, table)} Groups: "
                f"{', '.join(GROUPS)}; keywords: {', '.join(KEYWORDS)}"
            ) from None


def parse_hook_config(
    entries: Mapping[str, Any] | Iterable[str] | None,
) -> dict[str, dict[str, Any]]:
    """CLI entries (``hessian.iters=30``) or a mapping as ``{hook: {param: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    items: list[tuple[str, Any]] = []
    if isinstance(entries, Mapping):
        for key, value in entries.items():
            if isinstance(value, Mapping) and "." not in key:
                items.extend((f"{key}.{p}", v) for p, v in value.items())
            else:
                items.append((key, value))
    elif entries is not None:
        shape = {"shape": "name.param=value", "example": "hessian.iters=30"}
        for entry in entries:
            items.append(
                split_assignment(entry, what="hook config", error=HookSelectionError, **shape)
            )
    for key, value in items:
        hook, dot, param = key.partition(".")
        if not dot or not hook or not param:
            raise HookSelectionError(
                f"hook config key {key!r} must look like name.param (e.g. hessian.iters)"
            )
        out.setdefault(hook, {})[param] = value
    return out


def resolve_hook_names(hooks: Iterable[str] = (), with_hooks: str | None = None) -> list[str]:
    """The selected names in registration order, auto-included hooks added to any selection."""
    wanted: set[str] = set()
    for name in (n.strip() for item in hooks for n in str(item).split(",")):
        if name in GROUPS or name in KEYWORDS:
            wanted.update(HookRegistry.expand(name))
        elif name:
            wanted.add(HookRegistry.get(name).name)
    if with_hooks:
        wanted.update(HookRegistry.expand(with_hooks))
    if not wanted:
        return []
    wanted.update(h.name for h in HookRegistry.classes() if h.auto_include)
    return [n for n in HookRegistry.names() if n in wanted]


def select_hooks(
    hooks: Iterable[str] = (),
    with_hooks: str | None = None,
    hook_config: Mapping[str, Any] | Iterable[str] | None = None,
) -> list[TrainingHook]:
    """The selected hooks, configured; a :class:`HookSelectionError` lists the valid choices."""
    names = resolve_hook_names(hooks, with_hooks)
    config = parse_hook_config(hook_config)
    stray = [h for h in config if h not in names]
    if stray:
        for h in stray:
            HookRegistry.get(h)  # unknown name -> error listing the registered hooks
        raise HookSelectionError(
            f"configuration given for hook(s) {stray} that are not selected (selected: "
            f"{names or 'none'}); add them with --hooks {','.join(stray)}"
        )
    out = []
    for name in names:
        cls = HookRegistry.get(name)
        params = config.get(name, {})
        valid = list(cls.Config.model_fields)
        for p in params:
            if p not in valid:
                raise HookSelectionError(
                    f"hook {name!r} has no parameter {p!r}.{_suggest(p, valid)} Its parameters: "
                    f"{', '.join(valid)}"
                )
        try:
            out.append(cls(**params))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
                if e["loc"]
                else e["msg"].removeprefix("Value error, ")
                for e in exc.errors()
            )
            raise HookSelectionError(f"bad configuration for hook {name!r}: {problems}") from None
        except ValueError as exc:
            raise HookSelectionError(f"bad configuration for hook {name!r}: {exc}") from None
    return out
