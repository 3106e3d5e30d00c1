"""ComponentContext: the state that probes share with the loop that drives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PHASES = ("train", "rollout", "eval")


@dataclass
class ComponentContext:
    """Shared state between a training loop and the probes attached to a policy.

    Attributes:
        model_metrics: trackers keyed by probe name (``"relu"``, ``"fisher"``, ...).
            Builders get or create their tracker here; :class:`StatsReporter` reads them.
        phase: what the loop is doing now. Probes record only while ``phase`` is one of
            their ``phases`` (default ``("train",)``), so rollout inference never mixes
            with training samples. Trainers set ``"rollout"`` while collecting experience.
        loss_scale: the factor by which the loop multiplied the mean-reduced loss before
            ``backward()`` (for example ``1/k`` when a minibatch is split into ``k``
            micro-batches). The Fisher probe divides it out to recover per-sample
            gradients.
        strict: when True a probe that raises stops training; otherwise the probe is
            disabled, reported once, and counted in :attr:`probe_errors`.
        probe_errors: ``"<probe>/<component>" -> message`` for every probe disabled
            after raising.
    """

    model_metrics: dict[str, Any] = field(default_factory=dict)
    phase: str = "train"
    loss_scale: float = 1.0
    strict: bool = False
    probe_errors: dict[str, str] = field(default_factory=dict)
