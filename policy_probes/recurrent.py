"""Recurrent cores: the tensor a probe without an ``extractor`` reads, the per-step
``output`` of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (a ``PackedSequence``'s ``.data``) and
the ``h`` of ``nn.LSTMCell`` (``nn.GRUCell``/``nn.RNNCell`` return it). Every ``(step,
sequence)`` row is a sample, so a sequence called at once or per step gives the same
statistics. See ``docs/components.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence


def sequence_output(out: Any) -> torch.Tensor:
    """``output`` of ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (``.data`` if packed)."""
    first = out[0]
    return first.data if isinstance(first, PackedSequence) else first


def cell_hidden(out: Any) -> torch.Tensor:
    """``h`` of ``nn.LSTMCell``'s ``(h, c)``."""
    return out[0]


def default_extractor(module: nn.Module | None) -> Callable[[Any], torch.Tensor] | None:
    """The default extractor for a recurrent ``module``, or None (the output itself)."""
    if isinstance(module, nn.RNNBase):  # nn.LSTM, nn.GRU, nn.RNN
        return sequence_output
    if isinstance(module, nn.LSTMCell):
        return cell_hidden
    return None
