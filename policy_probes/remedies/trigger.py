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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_THRESHOLD = re.compile(r"^\s*(?P<key>[^<>=\s]+)\s*(?P<op>>=|<=|>|<)\s*(?P<value>\S+)\s*$")


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
        if every_epochs is not None and (isinstance(every_epochs, bool) or int(every_epochs) < 1):
            raise ValueError(f"every_epochs must be a positive integer, got {every_epochs!r}")
        if int(start_epoch) < 0 or int(cooldown) < 0:
            raise ValueError(
                f"start_epoch and cooldown must be >= 0, got {start_epoch!r}, {cooldown!r}"
            )
        threshold = Threshold.parse(when) if isinstance(when, str) else when
        every = None if every_epochs is None else int(every_epochs)
        return cls(every, threshold, int(start_epoch), int(cooldown))

    def due(self, epoch: int, metrics: Mapping[str, Any], last_fired: int | None) -> bool:
        """Whether to fire at the end of ``epoch`` (counted from 1)."""
        if epoch < self.start_epoch:
            return False
        if last_fired is not None and epoch - last_fired <= self.cooldown:
            return False
        if self.every_epochs is not None and epoch % self.every_epochs:
            return False
        return self.when is None or bool(self.when.holds(metrics))
