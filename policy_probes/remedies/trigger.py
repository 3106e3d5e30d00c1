"""When a remedy fires (checked at the end of every epoch, counted from 1, after its
metrics): ``every_epochs=k`` at epochs k, 2k, ...; ``when="<metric key><op><number>"``
when the epoch's metric compares true (not in an epoch without it); both: at the
scheduled epochs where it holds; never before ``start_epoch``, and at least ``cooldown``
epochs between firings (``docs/remedies.md``)."""

from __future__ import annotations

import difflib
import math
import operator
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_THRESHOLD = re.compile(r"^\s*(?P<key>[^<>=\s]+)\s*(?P<op>>=|<=|>|<)\s*(?P<value>\S+)\s*$")


#: ``probes/<name>`` keys the session writes itself, no probe: the sampler's overhead, faults
SESSION_PROBE_KEYS = frozenset({"overhead_fraction", "overhead_seconds", "errors"})


@dataclass(frozen=True)
class Produced:
    """What a run's records can hold, known at set-up (:meth:`Threshold.unproduced`)."""

    #: probe name -> the components it observes (None: not known)
    probes: Mapping[str, Collection[str] | None]
    #: probe name -> the metrics its plugin declares (for close matches)
    declared: Mapping[str, Collection[str]]
    #: whether :attr:`probes` holds every writer of ``probes/`` keys (False with a plain
    #: hook closure, which may make a tracker of its own while training)
    complete: bool = True
    #: the first segments of every key the loop writes (None: any loop key may appear)
    namespaces: Collection[str] | None = None

    def keys(self) -> list[str]:
        """The declared keys of the attached probes: ``probes/<probe>/<component>/<metric>``."""
        return [
            f"probes/{probe}/{component}/{metric}"
            for probe, components in self.probes.items()
            for component in components or ()
            for metric in self.declared.get(probe, ())
        ]


@dataclass(frozen=True)
class Threshold:
    """``key op value`` on the epoch's metrics."""

    key: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Threshold:
        """``"probes/relu/critic_mlp/dormant_fraction>0.3"`` -> Threshold."""
        m = _THRESHOLD.match(text)
        try:
            value = float(m["value"]) if m else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(
                f"when={text!r} is not a threshold; write '<metric key><op><number>' with op "
                f"one of {list(OPERATORS)}, e.g. when='probes/relu/critic_mlp/dormant_fraction>0.3'"
            )
        return cls(m["key"], m["op"], value)

    def holds(self, metrics: Mapping[str, Any]) -> bool | None:
        """Whether the metric compares true; None when the epoch has no such metric."""
        value = metrics.get(self.key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        return OPERATORS[self.op](float(value), self.value)

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value:g}"

    def misspelled(self, metrics: Mapping[str, Any]) -> str | None:
        """Why the key looks wrong when ``metrics`` lack it although its probe and
        component (or a key close to it) reported; None when it is there or the probe
        observed nothing."""
        if self.key in metrics:
            return None
        group = self.key.rsplit("/", 1)[0] + "/"
        keys = [k for k in metrics if isinstance(k, str)]
        close = difflib.get_close_matches(self.key, keys, n=3, cutoff=0.8)
        if not close and not any(k.startswith(group) for k in keys):
            return None
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return (
            f"when={str(self)!r}: the epoch's metrics have no key {self.key!r}, so this "
            f"remedy never fires{hint} (the keys are those in metrics.jsonl)"
        )

    def unproduced(self, produced: Produced) -> str | None:
        """Why no record of the run can hold the key (a probe that is not attached, a
        component it does not observe, a namespace the loop never writes), with the
        closest keys; None when it may appear. Checked at set-up, before training."""
        parts = self.key.split("/")
        if parts[0] == "probes" and len(parts) >= 3 and parts[1] not in SESSION_PROBE_KEYS:
            probe, components = parts[1], produced.probes.get(parts[1])
            if probe not in produced.probes and produced.complete:
                attached = ", ".join(sorted(produced.probes)) or "none"
                why = f"no attached probe is named {probe!r} (attached: {attached})"
            elif components is not None and len(parts) >= 4 and not _observes(components, parts[2]):
                observed = ", ".join(sorted(components)) or "none"
                why = f"the {probe} probe does not observe {parts[2]!r} (it observes: {observed})"
            else:
                return None
        elif produced.namespaces is not None and parts[0] not in produced.namespaces:
            spaces = ", ".join(f"{n}/" for n in sorted(produced.namespaces))
            why = f"this run writes no key under {parts[0] + '/'!r} (its keys: {spaces})"
        else:
            return None
        keys = produced.keys()
        close = difflib.get_close_matches(self.key, keys, n=3, cutoff=0.6)
        if not close:  # a bare metric name, or another probe's: the keys with that metric
            close = [k for k in keys if k.rsplit("/", 1)[-1] == parts[-1]][:3]
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return (
            f"when={str(self)!r}: {why}, so this remedy would never fire{hint} (a run's keys "
            f"are those in its metrics.jsonl; `policy-probes plugins` lists each probe's metrics)"
        )


def whole_number(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int`` when it is a whole number ``>= minimum`` (``3`` or ``3.0``);
    else a ValueError: ``every_epochs=1.5`` would otherwise be cut to 1 and fire every epoch."""
    try:
        whole = not isinstance(value, bool) and float(value) == int(value)
    except (TypeError, ValueError, OverflowError):  # not a number, inf, nan
        whole = False
    if not whole or int(value) < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return int(value)


def _observes(components: Collection[str], name: str) -> bool:
    """Whether ``name`` is one of ``components`` or a layer inside one (``actor_mlp.layer_0``)."""
    return any(name == c or name.startswith(f"{c}.") for c in components)


@dataclass(frozen=True)
class Trigger:
    """A remedy's firing rule (see the module docstring)."""

    every_epochs: int | None = None
    when: Threshold | None = None
    start_epoch: int = 0
    cooldown: int = 0

    @classmethod
    def build(
        cls,
        every_epochs: int | None,
        when: str | Threshold | None,
        start_epoch: int = 0,
        cooldown: int = 0,
    ) -> Trigger:
        """Checked arguments: a ``ValueError`` says what to change."""
        if every_epochs is None and when is None:
            raise ValueError(
                "a remedy needs a trigger: every_epochs=<k> (fire every k epochs), "
                "when='<metric><op><number>' (fire on a threshold), or both"
            )
        every = None if every_epochs is None else whole_number("every_epochs", every_epochs, 1)
        threshold = Threshold.parse(when) if isinstance(when, str) else when
        start, gap = (
            whole_number("start_epoch", start_epoch, 0),
            whole_number("cooldown", cooldown, 0),
        )
        return cls(every, threshold, start, gap)

    def due(self, epoch: int, metrics: Mapping[str, Any], last_fired: int | None) -> bool:
        """Whether to fire at the end of ``epoch`` (counted from 1)."""
        if epoch < self.start_epoch:
            return False
        if last_fired is not None and epoch - last_fired <= self.cooldown:
            return False
        if self.every_epochs is not None and epoch % self.every_epochs:
            return False
        return self.when is None or bool(self.when.holds(metrics))
