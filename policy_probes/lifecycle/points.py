"""Where in a training loop lifecycle hooks fire (in the order of :class:`HookPoint`;
``docs/lifecycle.md`` has the diagram), and for which epochs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum


class HookPoint(str, Enum):
    """A well-defined moment of the training loop."""

    PRE_EPOCH = "PRE_EPOCH"
    """Start of an epoch, before the rollout; parameters are those the update left."""
    POST_ROLLOUT = "POST_ROLLOUT"
    """The rollout and its advantages are ready; no update has happened yet."""
    PRE_STEP = "PRE_STEP"
    """After a minibatch's backward pass, before gradient clipping and ``optimizer.step()``."""
    POST_STEP = "POST_STEP"
    """Right after ``optimizer.step()``."""
    POST_EPOCH = "POST_EPOCH"
    """After the update phase, the scheduler step and evaluation."""
    SNAPSHOT = "SNAPSHOT"
    """After POST_EPOCH on every ``snapshot_every``-th epoch (the expensive diagnostics)."""

    @classmethod
    def parse(cls, value: str | HookPoint) -> HookPoint:
        """``"post_epoch"``, ``"POST_EPOCH"`` or a member; unknown names list the valid ones."""
        if isinstance(value, HookPoint):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            names = [p.name for p in cls]
            close = difflib.get_close_matches(str(value).upper(), names, n=2)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown hook point {value!r}; valid: {', '.join(names)}.{hint}"
            ) from None


STEP_POINTS: frozenset[HookPoint] = frozenset({HookPoint.PRE_STEP, HookPoint.POST_STEP})
"""Points that fire once per optimizer step; their metrics are buffered per epoch."""

LOOP_TYPES: tuple[str, ...] = ("ppo", "external")
"""``ppo``: the built-in trainer. ``external``: a loop driven through ProbeSession, which
fires only the points it knows (usually POST_EPOCH)."""


@dataclass(frozen=True)
class EpochWindow:
    """Inclusive range of epochs in which a hook may fire; ``None`` leaves a side open."""

    min_epoch: int | None = None
    max_epoch: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.min_epoch, self.max_epoch
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"epoch window ({lo}, {hi}) is empty: min_epoch must be <= max_epoch")

    def contains(self, epoch: int) -> bool:
        return (self.min_epoch is None or epoch >= self.min_epoch) and (
            self.max_epoch is None or epoch <= self.max_epoch
        )

    def intersect(self, other: EpochWindow) -> EpochWindow:
        lows = [v for v in (self.min_epoch, other.min_epoch) if v is not None]
        highs = [v for v in (self.max_epoch, other.max_epoch) if v is not None]
        return EpochWindow(max(lows) if lows else None, min(highs) if highs else None)


ALWAYS = EpochWindow()

# What a hook may declare in ``loop_points``: per loop type, either a list of points or a
# mapping point -> ``(min_epoch, max_epoch)`` window (``None`` for no window).
LoopPointsSpec = Mapping[
    str, Iterable[HookPoint | str] | Mapping[HookPoint | str, tuple[int | None, int | None] | None]
]


def resolve_points(
    loop: str, hook_points: Iterable[HookPoint | str], loop_points: LoopPointsSpec | None
) -> dict[HookPoint, EpochWindow]:
    """A hook's points (with windows) in a ``loop``: its ``hook_points``, or its ``loop_points``."""
    spec = hook_points if loop_points is None else loop_points.get(loop) or ()
    windows = spec if isinstance(spec, Mapping) else dict.fromkeys(spec)
    return {
        HookPoint.parse(p): ALWAYS if win is None else EpochWindow(*win)
        for p, win in windows.items()
    }


def snapshot_due(epoch: int, snapshot_every: int) -> bool:
    """Whether SNAPSHOT fires at ``epoch`` (from 0): every ``snapshot_every``-th, if > 0."""
    return snapshot_every > 0 and (epoch + 1) % snapshot_every == 0
