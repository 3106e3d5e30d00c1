"""Recurrent cores (LSTM, GRU, RNN and their cells): the tensor a probe reads by default.

``nn.LSTM`` returns ``(output, (h_n, c_n))``, ``nn.GRU``/``nn.RNN`` ``(output, h_n)`` and
``nn.LSTMCell`` ``(h, c)``, so a probe on them would need an ``extractor``. When a probe
without one is attached to such a module (or to a component that is one), it reads:

* ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: ``output``, the per-step output sequence (the top
  layer's ``h_t`` for every step); a ``PackedSequence`` output gives its ``.data``, the
  real steps only, so packed sequences need no row mask;
* ``nn.LSTMCell``: ``h`` (the hidden state, which is also the cell's output);
* ``nn.GRUCell`` / ``nn.RNNCell``: already return the hidden state tensor.

Passes and samples. Every call of the module is one pass; every row of the tensor read
(every dimension but the last) is one sample: one ``(step, sequence)`` pair. A sequence
of ``T`` steps of ``B`` sequences is one pass of ``T x B`` samples when the module is called
once on the whole sequence, and ``T`` passes of ``B`` samples when it is called once per
step; ``samples`` and the per-unit statistics are the same either way. The gradient a
backward probe reads is the gradient of the tensor read: for ``nn.LSTM``/``nn.GRU``
``output`` (called at once or per step, where the next step gets ``h_n``) it is the loss's
direct gradient at each step; for a cell, whose ``h`` is both the output and the next
step's state, it also carries the gradient that flows back from later steps.
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
