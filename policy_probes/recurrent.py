"""Recurrent cores (LSTM, GRU, RNN and their cells): the tensor a probe reads by default.

A probe attached without an ``extractor`` to such a module reads: for ``nn.LSTM`` /
``nn.GRU`` / ``nn.RNN`` the per-step ``output`` sequence (a ``PackedSequence`` gives its
``.data``, the real steps only); for ``nn.LSTMCell`` ``h``; ``nn.GRUCell`` and
``nn.RNNCell`` already return the hidden state. Every call is one pass and every row (one
``(step, sequence)`` pair) one sample, so a sequence called at once or step by step gives
the same ``samples`` and per-unit statistics. A cell's ``h`` is also the next step's
state, so its gradient carries what flows back from later steps; ``output``'s is the
loss's direct gradient at each step. See ``docs/components.md``.
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
    """The documented default extractor for a recurrent ``module``, or None (read the
    output itself)."""
    if isinstance(module, nn.RNNBase):  # nn.LSTM, nn.GRU, nn.RNN
        return sequence_output
    if isinstance(module, nn.LSTMCell):
        return cell_hidden
    return None
