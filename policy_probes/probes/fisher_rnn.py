"""Per-sample Fisher of ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` from their gate gradients.

A recurrent layer's weights act on every step through two pre-activations,
``A^x_t = x_t W_ih^T + b_ih`` and ``A^h_t = h_{t-1} W_hh^T + b_hh``. With their
gradients for the whole batch (one ordinary backward through a re-run of the layer),
the per-sample weight gradients are contractions over time,

    d l_b / d W_ih = sum_t dA^x_t[b] (x) x_t[b],   d l_b / d b_ih = sum_t dA^x_t[b]
    d l_b / d W_hh = sum_t dA^h_t[b] (x) h_{t-1}[b], d l_b / d b_hh = sum_t dA^h_t[b]

one batched matmul per weight and chunk of samples. The re-run follows PyTorch's cell
equations (LSTM gates i, f, g, o; GRU r, z, n with ``n = tanh(A^x_n + r * A^h_n)``).
Layers with ``proj_size`` go through the ``torch.func`` route instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from policy_probes.probes.fisher_rules import accumulate, chunks


def gate_rule_applies(module: nn.Module) -> bool:
    """Whether :func:`rnn_per_sample_squares` covers ``module``: a plain ``nn.LSTM``
    (without projections), ``nn.GRU`` or ``nn.RNN``."""
    return type(module) in (nn.LSTM, nn.GRU, nn.RNN) and not getattr(module, "proj_size", 0)


def _cell(
    module: nn.Module, ax: torch.Tensor, ah: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of ``module``'s cell from its two pre-activations."""
    if isinstance(module, nn.LSTM):
        i, f, g, o = (ax + ah).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if isinstance(module, nn.GRU):
        xr, xz, xn = ax.chunk(3, -1)
        hr, hz, hn = ah.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, None
    pre = ax + ah
    return (torch.tanh(pre) if module.nonlinearity == "tanh" else torch.relu(pre)), None


@dataclass
class _Direction:
    """One layer and direction of a re-run: its parameters' name suffix, input ``x``
    (time, batch, features), per step the previous hidden state ``prev`` and the
    pre-activations ``ax``, ``ah`` (lists during the re-run; after :func:`_gate_grads`
    stacked in time order, ``ax``/``ah`` then holding their gradients)."""

    suffix: str
    x: torch.Tensor
    prev: Any
    ax: Any
    ah: Any


def _rerun(
    module: nn.Module, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[_Direction]]:
    """The layer re-run on ``x`` (time, batch, features) from ``h0``/``c0`` (layers x
    directions, batch, hidden): its output, h_n, c_n and every :class:`_Direction`."""
    dirs = 2 if module.bidirectional else 1
    steps = x.shape[0]
    saved, h_n, c_n = [], [], []
    layer_in = x
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
            b_ih = getattr(module, "bias_ih" + sfx) if module.bias else None
            b_hh = getattr(module, "bias_hh" + sfx) if module.bias else None
            ax = F.linear(layer_in, w_ih.detach(), _detach(b_ih))
            h, c = h0[layer * dirs + d], None if c0 is None else c0[layer * dirs + d]
            step = _Direction(sfx, layer_in.detach(), [h] * steps, ax, [h] * steps)
            hs = [h] * steps
            for t in range(steps - 1, -1, -1) if d else range(steps):
                step.prev[t] = h.detach()
                step.ah[t] = F.linear(h, w_hh.detach(), _detach(b_hh))
                h, c = _cell(module, ax[t], step.ah[t], h, c)
                hs[t] = h
            h_n.append(h)
            if c is not None:
                c_n.append(c)
            outs.append(torch.stack(hs))
            saved.append(step)
        layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
    return layer_in, torch.stack(h_n), torch.stack(c_n) if c_n else None, saved


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _gate_grads(module: nn.Module, call: Any, w: torch.Tensor) -> list[_Direction]:
    """Re-run one pass (``call``: inputs, h_0 and c_0, output gradients) and
    backpropagate ``<outputs, w g>`` to every pre-activation."""
    lstm = isinstance(module, nn.LSTM)
    lay = call.layout
    x, h0 = lay.leaves[0], lay.leaves[1]
    c0 = lay.leaves[2] if lstm else None
    g_out, g_h = call.grads[0], call.grads[1]
    g_c = call.grads[2] if lstm else None
    if module.batch_first:  # the re-run is time-major
        x = x.transpose(0, 1)
        g_out = None if g_out is None else g_out.transpose(0, 1)
    with torch.enable_grad():
        # leaves that require grad: every pre-activation is then in the graph
        x, h0 = x.detach().requires_grad_(), h0.detach().requires_grad_()
        c0 = None if c0 is None else c0.detach().requires_grad_()
        out, h_n, c_n, saved = _rerun(module, x, h0, c0)
        total = 0
        for y, g in ((out, g_out), (h_n, g_h), (c_n, g_c)):  # batch: dim 1 of each
            if g is not None and y is not None:
                total = total + (y * (g * w.to(g.dtype).view(1, -1, 1))).sum()
        wanted = [t for s in saved for t in (s.ax, *s.ah)]
        grads = torch.autograd.grad(total, wanted, allow_unused=True)
    out_grads, pos = [], 0
    for s in saved:
        own = (s.ax, *s.ah)
        mine = grads[pos : pos + len(own)]
        pos += len(own)
        got = [torch.zeros_like(t) if g is None else g for g, t in zip(mine, own, strict=True)]
        out_grads.append(
            _Direction(s.suffix, s.x, torch.stack(s.prev), got[0], torch.stack(got[1:]))
        )
    return out_grads


def rnn_per_sample_squares(
    module: nn.Module, calls: Sequence[Any], w: torch.Tensor, chunk_bytes: int
) -> dict[str, torch.Tensor]:
    """:func:`~policy_probes.probes.fisher_generic.per_sample_squares` for a module
    :func:`gate_rule_applies` to (layout leaves: input, h_0, and c_0 for an LSTM)."""
    joined = _joined(calls)
    if joined is None:
        per_call = [_gate_grads(module, call, w) for call in calls]
    else:  # one re-run and one backward for all the calls
        per_call = [_by_call(_gate_grads(module, joined, w.repeat(len(calls))), len(calls))]
    width = sum(d.ax.shape[-1] * (d.x.shape[-1] + d.prev.shape[-1]) for d in per_call[0])
    acc: dict[str, torch.Tensor] = {}
    for j, first in enumerate(per_call[0]):
        # a sample's gradient sums over every call's steps: one time axis for all calls
        dax, x, dah, prev = (
            torch.cat([getattr(directions[j], k) for directions in per_call])
            for k in ("ax", "x", "ah", "prev")
        )
        for lo, hi in chunks(w.shape[0], 3 * width * w.element_size(), chunk_bytes):
            b = slice(lo, hi)
            sample_grads = {
                "weight_ih": torch.einsum("tbg,tbi->bgi", dax[:, b], x[:, b]),
                "weight_hh": torch.einsum("tbg,tbi->bgi", dah[:, b], prev[:, b]),
            }
            if module.bias:
                sample_grads["bias_ih"] = dax[:, b].sum(0)
                sample_grads["bias_hh"] = dah[:, b].sum(0)
            for k, v in sample_grads.items():
                accumulate(acc, k + first.suffix, v.square().sum(0))
    return acc


def _joined(calls: Sequence[Any]) -> Any | None:
    """The calls of one backward (a per-step loop) as one pass over ``len(calls) x batch``
    samples, concatenated along the batch; None for one call or calls that differ in
    shapes or layout."""
    if len(calls) < 2:
        return None
    lay = calls[0].layout
    dims = [*lay.in_dims, *lay.out_dims]
    # an output gradient that did not arrive (the last step's h_n and c_n unused) is zero
    present = [
        next((g for c in calls if (g := c.grads[i]) is not None), None)
        for i in range(len(lay.out_dims))
    ]
    for call in calls:
        if call.layout.in_dims != lay.in_dims or call.layout.out_dims != lay.out_dims:
            return None
        refs = [*lay.leaves, *present]
        for t, ref, dim in zip([*call.layout.leaves, *call.grads], refs, dims, strict=True):
            if t is not None and (
                not isinstance(t, torch.Tensor) or dim is None or t.shape != ref.shape
            ):
                return None

    def cat(parts: list[Any], dim: int | None, ref: Any) -> Any:
        if ref is None:
            return None
        return torch.cat([torch.zeros_like(ref) if t is None else t for t in parts], dim)

    leaves = [
        cat([c.layout.leaves[i] for c in calls], d, lay.leaves[i])
        for i, d in enumerate(lay.in_dims)
    ]
    grads = [cat([c.grads[i] for c in calls], d, present[i]) for i, d in enumerate(lay.out_dims)]
    layout = dataclasses.replace(lay, leaves=leaves, batch=lay.batch * len(calls))
    return dataclasses.replace(calls[0], layout=layout, grads=grads, weight=None)


def _by_call(directions: list[_Direction], calls: int) -> list[_Direction]:
    """The joined re-run's (time, calls x batch, ...) as (calls x time, batch, ...)."""

    def steps(t: torch.Tensor) -> torch.Tensor:
        time_, rows = t.shape[0], t.shape[1] // calls
        return t.reshape(time_, calls, rows, -1).transpose(0, 1).reshape(calls * time_, rows, -1)

    return [
        _Direction(d.suffix, steps(d.x), steps(d.prev), steps(d.ax), steps(d.ah))
        for d in directions
    ]
