"""Row masks: rows the loss leaves out (padded sequence steps) are left out of every probe.

Inside ``with session.row_mask(mask): ...`` every built-in tracker weighs each row by its
mask entry at the drain, so a masked row changes no statistic and no ``samples`` count;
hooks only bind a view of the mask to their tensor (no host sync). How a mask lines up
with a probed tensor: ``docs/external.md``, "Masked rows".
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

#: sequence modules whose output is time-major unless ``batch_first``
SEQUENCE_MODULES = (nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention)

_serials = itertools.count()


class RowMask:
    """A 0/1 row mask, ``(rows,)`` or ``(batch, time)`` (non-zero = kept), held once as float
    weights on its device (hooks take views), with the step counters of per-step calls."""

    def __init__(self, mask: torch.Tensor) -> None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(
                f"row_mask needs a torch.Tensor of 0/1 per row (1 = the loss uses the row), "
                f"got {type(mask).__name__}"
            )
        if mask.dim() not in (1, 2) or mask.numel() == 0:
            raise ValueError(
                f"row_mask needs a non-empty mask of shape (rows,) or (batch, time), got shape "
                f"{tuple(mask.shape)}; reshape it, e.g. mask.reshape(n_sequences, -1)"
            )
        if mask.is_complex():
            raise TypeError("row_mask needs a bool or real mask, got a complex tensor")
        #: tells masks apart (ids of freed objects are reused): one per row_mask block
        self.serial = next(_serials)
        self.shape = tuple(mask.shape)
        self.weights = (mask.detach() != 0).to(torch.float32)
        self._flat = self.weights.reshape(-1)
        self._steps: dict[Any, int] = {}
        self._on: dict[torch.device, RowMask] = {}
        self._kept: torch.Tensor | None = None
        self._time_major: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def kept(self) -> torch.Tensor:
        """Number of kept rows, a 0-dim float tensor on the mask's device (no sync)."""
        if self._kept is None:
            self._kept = self._flat.sum()
        return self._kept

    def on(self, device: torch.device) -> RowMask:
        """This mask on ``device`` (copied once per device, non-blocking)."""
        if device == self.weights.device:
            return self
        other = self._on.get(device)
        if other is None:
            moved = self.weights.to(device, non_blocking=device.type != "cpu")
            other = self._on[device] = RowMask(moved)
            other._steps = self._steps  # one step count per module, on every device
        return other

    def weight_for(
        self,
        tensor: torch.Tensor,
        module: nn.Module | None,
        component: str,
        key: Any,
        channels_first: bool = False,
    ) -> torch.Tensor:
        """The ``(rows,)`` mask entries of ``tensor``'s rows (``key``: the caller, for per-step
        calls); with ``channels_first`` (``(B, C, *spatial)``) ``(B, positions)``, expanded."""
        if channels_first and tensor.dim() >= 3:
            per_sample = math.prod(tensor.shape[2:])
            weight = self._sample_weight(tensor, (tensor.shape[0],), None, component, key)
            return weight[:, None].expand(-1, per_sample)
        return self._sample_weight(tensor, tuple(tensor.shape[:-1]), module, component, key)

    def per_sample(
        self,
        tensor: torch.Tensor,
        samples: int,
        rows: int,
        module: nn.Module | None,
        component: str,
        key: Any,
    ) -> torch.Tensor:
        """The ``(samples,)`` mask entries of samples of ``rows / samples`` rows each (a conv's
        positions, an ``nn.LSTM``'s steps): a sample is kept when any of its rows is."""
        mask = self.on(tensor.device)
        if self.numel == samples:
            return mask._flat
        if self.numel == rows and rows % samples == 0:
            if (
                len(self.shape) == 1
                and isinstance(module, SEQUENCE_MODULES)
                and not module.batch_first
            ):  # a flat mask in the rows' (time, batch) order
                return mask._flat.view(-1, samples).amax(0)
            return mask._flat.view(samples, -1).amax(1)
        return self._sample_weight(tensor, (samples,), module, component, key)

    def _sample_weight(
        self,
        tensor: torch.Tensor,
        lead: tuple[int, ...],
        module: nn.Module | None,
        component: str,
        key: Any,
    ) -> torch.Tensor:
        """The mask entries of the ``lead`` sample rows of ``tensor``."""
        mask = self.on(tensor.device)
        rows = math.prod(lead)
        if rows == self.numel:
            if (
                len(self.shape) == 2
                and tensor.dim() == 3
                and (
                    (isinstance(module, SEQUENCE_MODULES) and not module.batch_first)
                    # (time, batch) rows of a (batch, time) mask: a component wrapping a
                    # time-major sequence module (told apart only when batch != time)
                    or (tensor.shape[:2] == self.shape[::-1] and self.shape[0] != self.shape[1])
                )
            ):
                if mask._time_major is None:  # (time, batch) rows; one copy per mask
                    mask._time_major = mask.weights.T.reshape(-1)
                return mask._time_major
            return mask._flat
        if len(self.shape) == 2 and rows == self.shape[0]:
            step = self._steps.get(key, 0)
            if step >= self.shape[1]:
                raise ValueError(
                    f"component {component!r} was called {step + 1} times inside one "
                    f"row_mask block, but the (batch, time) mask {self.shape} has "
                    f"{self.shape[1]} steps; enter a new row_mask block per minibatch"
                )
            self._steps[key] = step + 1
            return mask.weights[:, step]
        if len(lead) == 1 and tensor.dim() >= 3:
            rule = "read per channel: one row per sample, axis 0"
        else:
            rule = "every dimension but the last is a row"
        raise ValueError(
            f"row_mask: the mask has shape {self.shape} ({self.numel} rows) but component "
            f"{component!r} produced a tensor with {rows} rows (shape {tuple(tensor.shape)}, "
            f"{rule}). Pass one mask entry per row of the "
            f"minibatch, shape ({rows},) in the order the rows are flattened, or a (batch, "
            f"time) mask for sequences (a per-step call of batch rows reads one column)"
        )


def bound_weight(
    context: Any,
    tensor: torch.Tensor,
    module: nn.Module | None,
    component: str,
    key: Any,
    channels_first: bool = False,
) -> torch.Tensor | None:
    """The mask rows of ``tensor`` under ``context.row_mask`` (None without a mask); call
    it when the tensor is produced, so per-step calls count in order."""
    mask = getattr(context, "row_mask", None)
    return None if mask is None else mask.weight_for(tensor, module, component, key, channels_first)


def loss_samples(context: Any, rows: int, like: torch.Tensor) -> float | torch.Tensor:
    """How many samples the loss averages over: ``context.loss_samples`` if set, else the
    row mask's kept rows (a device tensor, no sync), else ``rows``."""
    stated = getattr(context, "loss_samples", None)
    if stated is not None:
        return stated
    mask = getattr(context, "row_mask", None)
    if mask is not None:
        return mask.on(like.device).kept()
    return rows
