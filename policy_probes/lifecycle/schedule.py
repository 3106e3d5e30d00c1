"""StepSchedule: on which optimizer steps (or epochs) a hook fires.

* ``continual``: every index from ``warmup`` on.
* ``stride``: every ``every``-th index from ``warmup`` on (``warmup``, ``warmup+every``, ...).
* ``burst``: ``length`` consecutive indices out of every ``every`` from ``warmup`` on.

At PRE_STEP/POST_STEP the index is the global optimizer step (counted from 0 over the
whole run); at the epoch points the index is the epoch as the records number it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScheduleMode = Literal["continual", "stride", "burst"]


@dataclass(frozen=True)
class StepSchedule:
    mode: ScheduleMode = "continual"
    every: int = 1
    length: int = 1
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("continual", "stride", "burst"):
            raise ValueError(
                f"unknown schedule mode {self.mode!r}; use 'continual', 'stride' or 'burst'"
            )
        if self.every < 1:
            raise ValueError(f"schedule 'every' must be >= 1, got {self.every}")
        if self.length < 1 or (self.mode == "burst" and self.length > self.every):
            raise ValueError(f"burst length must be in [1, every={self.every}], got {self.length}")
        if self.warmup < 0:
            raise ValueError(f"schedule warmup must be >= 0, got {self.warmup}")

    @classmethod
    def continual(cls, warmup: int = 0) -> StepSchedule:
        return cls("continual", warmup=warmup)

    @classmethod
    def stride(cls, every: int, warmup: int = 0) -> StepSchedule:
        return cls("stride", every=every, warmup=warmup)

    @classmethod
    def burst(cls, length: int, every: int, warmup: int = 0) -> StepSchedule:
        return cls("burst", every=every, length=length, warmup=warmup)

    @classmethod
    def parse(cls, spec: str | StepSchedule) -> StepSchedule:
        """``continual``, ``stride:4`` or ``burst:2/10``, each optionally with ``,warmup:N``."""
        if isinstance(spec, StepSchedule):
            return spec
        usage = (
            "expected 'continual', 'stride:N' or 'burst:K/N', optionally followed by "
            "',warmup:W' (e.g. 'burst:2/10,warmup:100')"
        )
        parts = [p.strip() for p in str(spec).split(",") if p.strip()]
        if not parts:
            raise ValueError(f"empty schedule; {usage}")
        warmup = 0
        for extra in parts[1:]:
            key, _, value = extra.partition(":")
            if key != "warmup" or not value.strip().isdigit():
                raise ValueError(f"bad schedule option {extra!r} in {spec!r}; {usage}")
            warmup = int(value)
        mode, _, arg = parts[0].partition(":")
        try:
            if mode == "continual" and not arg:
                return cls.continual(warmup)
            if mode == "stride":
                return cls.stride(int(arg), warmup)
            if mode == "burst":
                length, _, every = arg.partition("/")
                return cls.burst(int(length), int(every), warmup)
        except ValueError as exc:
            if "schedule" in str(exc) or "burst" in str(exc):
                raise
        raise ValueError(f"bad schedule {spec!r}; {usage}")

    def due(self, index: int) -> bool:
        """Whether the hook fires at step (or epoch) ``index``."""
        k = index - self.warmup
        if k < 0:
            return False
        if self.mode == "continual":
            return True
        if self.mode == "stride":
            return k % self.every == 0
        return k % self.every < self.length

    def __str__(self) -> str:
        base = {
            "continual": "continual",
            "stride": f"stride:{self.every}",
            "burst": f"burst:{self.length}/{self.every}",
        }[self.mode]
        return f"{base},warmup:{self.warmup}" if self.warmup else base
