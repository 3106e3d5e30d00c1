"""Remedies, bound to components, and the runner that fires them at the end of an epoch.

A :class:`Remedy` is configuration (``redo(tau=0.025, every_epochs=25)``); attaching it to
a component binds it (:class:`BoundRemedy`: the component's layers, the optimiser, its own
``torch.Generator`` and its firing record, which checkpoints store)."""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from torch import nn

from policy_probes.context import ComponentContext
from policy_probes.remedies.optim_state import check_optimizer
from policy_probes.remedies.trigger import Threshold, Trigger, whole_number

log = logging.getLogger("policy_probes")


@dataclass
class RemedyTarget:
    """What a remedy acts on: one component of a policy and the loop's optimiser."""

    component: str
    module: nn.Module
    policy: Any  # the PolicyAutoBuilder (get_component, component_consumers)
    context: ComponentContext
    optimizer: torch.optim.Optimizer


class RemedyOptions(TypedDict, total=False):
    """A triggered remedy factory's keyword-only ``**options``: trigger settings and ``seed``."""

    start_epoch: int
    cooldown: int
    seed: int | None


class Remedy:
    """Base of the remedies: a name, a trigger and an optional seed. Subclasses implement
    :meth:`prepare` (checks and layer lookup, at attach time) and :meth:`apply`; one with
    state of its own returns it from :meth:`state_dict` (checkpoints carry it). Per-step
    remedies (:class:`~policy_probes.remedies.step_remedy.StepRemedy`) have no trigger."""

    kind = "remedy"
    name: str = "remedy"
    docs = "docs/remedies.md"
    #: the keywords a spec may give besides the constructor's own (its ``**trigger``)
    spec_keys = ("every_epochs", "when", "start_epoch", "cooldown", "seed")
    #: the attributes holding its own arguments (:meth:`settings`)
    setting_names: tuple[str, ...] = ()
    trigger: Trigger | None

    def __init__(
        self,
        *,
        every_epochs: int | None = None,
        when: str | Threshold | None = None,
        start_epoch: int = 0,
        cooldown: int = 0,
        seed: int | None = None,
    ) -> None:
        self.trigger = Trigger.build(every_epochs, when, start_epoch, cooldown)
        self.seed = None if seed is None else whole_number("seed", seed, 0)

    def reads_components(self, component: str) -> list[str]:
        """The components a ``when=`` on a ``probes/`` key reads (the sampler pins them)."""
        when = getattr(self.trigger, "when", None)  # per-step remedies have no trigger
        if when is None or not when.key.startswith("probes/"):
            return []
        parts = when.key.split("/")
        return [parts[2].split(".")[0]] if len(parts) > 3 else []

    def prepare(self, target: RemedyTarget) -> Any:
        """What :meth:`apply` needs about ``target`` (checked once, when attached)."""
        raise NotImplementedError

    def apply(
        self, target: RemedyTarget, prepared: Any, generator: torch.Generator
    ) -> dict[str, int] | None:
        """Change the weights now; units reset per layer name (None: it did not fire)."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """The remedy's own arguments (for ``repr`` and the run's configuration)."""
        return {name: getattr(self, name) for name in self.setting_names}

    def start(self, target: RemedyTarget, prepared: Any, generator: torch.Generator) -> None:
        """Called once bound (its generator seeded); per-step remedies hook the optimizer."""

    def epoch_metrics(self, target: RemedyTarget, prepared: Any) -> dict[str, float]:
        """What a per-step remedy did in the epoch (a key without ``/``: under the component)."""
        return {}

    def state_dict(self, prepared: Any) -> dict[str, Any]:
        """The remedy's own state on one component (checkpoints carry it)."""
        return {}

    def load_state_dict(self, prepared: Any, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""

    def __repr__(self) -> str:
        trigger = {} if self.trigger is None else vars(self.trigger)
        args = {**self.settings(), **trigger, "seed": self.seed}
        text = ", ".join(
            f"{k}={(str(v) if k == 'when' else v)!r}" for k, v in args.items() if v is not None
        )
        return f"{self.name}({text})"


def checked(name: str, value: Any, ok: Callable[[float], bool], rule: str) -> float:
    """``float(value)`` if it is finite and ``ok`` holds (never for a bool), else a
    ValueError: name must be rule (``tau=inf`` would also reach ``config.json`` as a
    number JSON has not)."""
    if not isinstance(value, bool) and not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite and {rule}, got {value!r}")
    if isinstance(value, bool) or not ok(float(value)):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return float(value)


def name_list(names: Sequence[str] | str | None) -> list[str] | None:
    """Layer or component names as a list (one may be given as a string), or ``None``."""
    return None if names is None else [names] if isinstance(names, str) else list(names)


def check_remedy(remedy: object) -> Remedy:
    """``remedy`` if it is one, else a ``TypeError`` saying what was expected."""
    if not isinstance(remedy, Remedy):
        raise TypeError(
            f"expected a remedy such as policy_probes.remedies.redo(...), got "
            f"{type(remedy).__name__}; did you forget the parentheses?"
        )
    return remedy


def remedy_seed(base: int, name: str, component: str) -> int:
    """The generator seed of ``name`` on ``component`` (distinct streams from one seed)."""
    return (int(base) * 1_000_003 + zlib.crc32(f"{name}@{component}".encode())) % 2**63


class BoundRemedy:
    """A remedy attached to one component, with its generator and firing record."""

    def __init__(self, remedy: Remedy, target: RemedyTarget, seed: int) -> None:
        check_optimizer(target.optimizer)
        self.remedy, self.target = remedy, target
        self.prepared = remedy.prepare(target)
        self.key = f"{remedy.name}@{target.component}"
        self.generator = torch.Generator().manual_seed(
            remedy_seed(seed, remedy.name, target.component)
        )
        self.last_fired: int | None = None
        self.firings = 0
        self.warned_key = False  # a `when=` key the metrics never hold: said once
        remedy.start(target, self.prepared, self.generator)
        # what it reads from the probes must not depend on measured time (the budget's)
        sampler = target.context.sampler
        if sampler is not None:
            for component in remedy.reads_components(target.component):
                sampler.pin(component)

    def end_epoch(self, epoch: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Fire when due at the end of ``epoch`` (counted from 1); the epoch's metrics."""
        root = f"remedies/{self.remedy.name}"
        prefix = f"{root}/{self.target.component}"
        if self.remedy.trigger is None:  # acts at every optimizer step
            return {
                (f"{root}/{k}" if "/" in k else f"{prefix}/{k}"): v
                for k, v in self.remedy.epoch_metrics(self.target, self.prepared).items()
            }
        when = self.remedy.trigger.when
        if when is not None and not self.warned_key:
            problem = when.misspelled(metrics)
            if problem is not None:
                self.warned_key = True
                log.warning("remedy %s: %s", self.key, problem)
        per_layer = None
        if self.remedy.trigger.due(epoch, metrics, self.last_fired):
            per_layer = self.remedy.apply(self.target, self.prepared, self.generator)
        if per_layer is None:  # not due, or declined (a one-off that has acted already)
            return {f"{prefix}/fired": 0.0, f"{prefix}/units_reset": 0.0}
        self.last_fired, self.firings = epoch, self.firings + 1
        out: dict[str, Any] = {f"{prefix}/fired": 1.0}
        out[f"{prefix}/units_reset"] = float(sum(per_layer.values()))
        for layer, units in per_layer.items():
            if layer != self.target.component:
                out[f"{root}/{layer}/units_reset"] = float(units)
        log.info("remedy %s fired at epoch %d: %s", self.key, epoch, per_layer)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "last_fired": self.last_fired,
            "firings": self.firings,
            "remedy": self.remedy.state_dict(self.prepared),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.last_fired = None if state["last_fired"] is None else int(state["last_fired"])
        self.firings = int(state["firings"])
        if state["remedy"]:  # an empty dict: the remedy keeps no state of its own
            self.remedy.load_state_dict(self.prepared, state["remedy"])


class RemedyRunner:
    """The bound remedies of a loop, fired in the order they were attached."""

    def __init__(self) -> None:
        self.bound: list[BoundRemedy] = []

    def add(self, remedy: Remedy, target: RemedyTarget, seed: int) -> BoundRemedy:
        check_remedy(remedy)
        key = f"{remedy.name}@{target.component}"
        if any(b.key == key for b in self.bound):  # checked before binding: no hooks left
            raise ValueError(f"{key} is attached twice; attach each remedy once per component")
        bound = BoundRemedy(remedy, target, seed)
        self.bound.append(bound)
        return bound

    def attach(
        self,
        policy: Any,
        pattern: str,
        remedy: Remedy,
        context: ComponentContext,
        optimizer: torch.optim.Optimizer,
        seed: int,
    ) -> list[BoundRemedy]:
        """Bind ``remedy`` to every component ``pattern`` names (``seed``: when it has none)."""
        check_remedy(remedy)
        base = remedy.seed if remedy.seed is not None else seed
        targets = (
            RemedyTarget(name, policy.get_component(name), policy, context, optimizer)
            for name in policy.resolve(pattern)
        )
        return [self.add(remedy, target, base) for target in targets]

    def __bool__(self) -> bool:
        return bool(self.bound)

    def end_epoch(self, epoch: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for bound in self.bound:
            out.update(bound.end_epoch(epoch, metrics))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {b.key: b.state_dict() for b in self.bound}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for b in self.bound:
            saved = state.get(b.key)
            if saved is None:
                log.warning("the saved state holds no record of remedy %s; it starts afresh", b.key)
                continue
            b.load_state_dict(saved)
        for key in set(state) - {b.key for b in self.bound}:
            log.warning("the saved state holds remedy %s, which this run does not attach", key)
