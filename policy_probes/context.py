"""ComponentContext: the state that probes share with the loop that drives them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("policy_probes")

PHASES = ("train", "rollout", "eval")


class ComponentContext:
    """Shared state between a training loop and the probes attached to a policy.

    Attributes:
        model_metrics: trackers keyed by probe name (``"relu"``, ``"fisher"``, ...), read
            by :class:`StatsReporter`.
        phase: what the loop is doing now (``"rollout"``, ``"train"``, ``"eval"``; the
            lifecycle layer's ``"hook"``); probes record only in their ``phases``.
        loss_scale: the factor the loop multiplied the mean loss by before ``backward()``
            (``1/k`` for ``k`` micro-batches; a 0-dim device tensor is never read back).
        loss_samples: how many samples the loss averages over when that is not the rows
            of one probed pass (``None``: :func:`~policy_probes.row_mask.loss_samples`).
            The Fisher probe's per-sample factor is ``loss_samples / loss_scale``.
        row_mask: the :class:`~policy_probes.row_mask.RowMask` of the rows the loss uses
            (assign a tensor); ``None``: every row.
        strict: a probe that raises stops training; otherwise it is disabled, reported
            once and counted in :attr:`probe_errors` (``"<probe>/<component>" -> message``).
        infer_phase: set while the loop has not said what it does: forward passes without
            gradients are then taken as rollout or evaluation, not recorded.
    """

    def __init__(
        self,
        model_metrics: dict[str, Any] | None = None,
        phase: str = "train",
        loss_scale: float | torch.Tensor = 1.0,
        strict: bool = False,
        probe_errors: dict[str, str] | None = None,
    ) -> None:
        self.model_metrics: dict[str, Any] = {} if model_metrics is None else model_metrics
        self._phase = phase
        self.loss_scale = loss_scale
        self.strict = strict
        self.probe_errors: dict[str, str] = {} if probe_errors is None else probe_errors
        self._phase_listeners: list[Callable[[str], None]] = []
        self.loss_samples: Any = None  # float or a 0-dim tensor
        self._row_mask: Any = None
        self.infer_phase = False
        self._inferred_once = False
        self.sampler: Any = None  # which passes probes observe (None: every pass)
        #: the run's fixed reference states, a ``ReferenceStates`` (a session sets it)
        self.reference_states: Any = None

    @property
    def row_mask(self) -> Any:
        return self._row_mask

    @row_mask.setter
    def row_mask(self, mask: Any) -> None:
        """A tensor (wrapped in a RowMask), a RowMask, or None (every row counts)."""
        from policy_probes.row_mask import RowMask

        if mask is not None and not isinstance(mask, RowMask):
            mask = RowMask(mask)
        self._row_mask = mask

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value != self._phase:
            self._phase = value
            self.resync()

    def resync(self) -> None:
        """Tell the phase listeners to re-check which hooks to install (pass boundaries)."""
        for listener in self._phase_listeners:
            listener(self._phase)

    def inference_pass(self) -> bool:
        """Whether the forward pass under way is inferred not to be training (no phase set,
        :attr:`infer_phase`, and gradients off); host-side flags only, warns once."""
        if not self.infer_phase or torch.is_grad_enabled():
            return False
        if not self._inferred_once:
            self._inferred_once = True
            log.warning(
                "no phase set: forward passes without gradients (torch.no_grad / "
                "inference_mode) are taken as rollout passes and not recorded by forward "
                "probes; call set_phase('rollout'/'train') to say it explicitly"
            )
        return True

    def add_phase_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(phase)`` whenever the phase changes (once per listener)."""
        if listener not in self._phase_listeners:
            self._phase_listeners.append(listener)

    def remove_phase_listener(self, listener: Callable[[str], None]) -> None:
        if listener in self._phase_listeners:
            self._phase_listeners.remove(listener)

    def __repr__(self) -> str:
        return (
            f"ComponentContext(phase={self._phase!r}, trackers={list(self.model_metrics)}, "
            f"loss_scale={self.loss_scale}, strict={self.strict}, "
            f"probe_errors={self.probe_errors})"
        )
