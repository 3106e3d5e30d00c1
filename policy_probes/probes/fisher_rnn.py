"""Per-sample Fisher of ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` from their gate gradients.

A recurrent layer's weights act on every step through two pre-activations,
``A^x_t = x_t W_ih^T + b_ih`` and ``A^h_t = h_{t-1} W_hh^T + b_hh``. With their
gradients for the whole batch (one ordinary backward through a re-run of the layer),
the per-sample weight gradients are contractions over time,

    d l_b / d W_ih = sum_t dA^x_t[b] (x) x_t[b],   d l_b / d b_ih = sum_t dA^x_t[b]
    d l_b / d W_hh = sum_t dA^h_t[b] (x) h_{t-1}[b], d l_b / d b_hh = sum_t dA^h_t[b]

one batched matmul per weight and chunk of samples, instead of ``vmap`` materialising
one gradient per sample and step. The re-run follows PyTorch's cell equations (gate
order i, f, g, o for the LSTM; r, z, n with ``n = tanh(A^x_n + r * A^h_n)`` for the
GRU). Layers with ``proj_size`` go through the ``torch.func`` route instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from policy_probes.probes.fisher_rules import chunks
from policy_probes.probes.state import SUM


def gate_rule_applies(module: nn.Module) -> bool:
    """Whether :func:`rnn_per_sample_squares` covers ``module``: a plain ``nn.LSTM``
    (without projections), ``nn.GRU`` or ``nn.RNN``."""
    kinds = (nn.LSTM, nn.GRU, nn.RNN)
    if type(module) not in kinds:
        return False
    return not getattr(module, "proj_size", 0)


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


def _rerun(
    module: nn.Module, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[dict[str, Any]]]:
    """The layer re-run on ``x`` (time, batch, features) from ``h0``/``c0`` (layers x
    directions, batch, hidden): its output, h_n, c_n and, per (layer, direction), the
    tensors the per-sample gradients need (inputs, previous states, pre-activations)."""
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
            ax = torch.nn.functional.linear(layer_in, w_ih.detach(), _detach(b_ih))
            k = layer * dirs + d
            h = h0[k]
            c = c0[k] if c0 is not None else None
            order = range(steps - 1, -1, -1) if d else range(steps)
            prev, ahs, hs = [], [], [None] * steps
            for t in order:
                ah = torch.nn.functional.linear(h, w_hh.detach(), _detach(b_hh))
                prev.append(h)
                ahs.append(ah)
                h, c = _cell(module, ax[t], ah, h, c)
                hs[t] = h
            h_n.append(h)
            if c is not None:
                c_n.append(c)
            outs.append(torch.stack(hs))
            time = list(order)
            saved.append(
                {
                    "suffix": sfx,
                    "x": layer_in.detach(),
                    "ax": ax,
                    # per step in processing order; reindexed to time order below
                    "prev": [p.detach() for p in prev],
                    "ah": ahs,
                    "time": time,
                }
            )
        layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
    return layer_in, torch.stack(h_n), torch.stack(c_n) if c_n else None, saved


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def rnn_per_sample_squares(
    module: nn.Module, calls: Sequence[Any], w: torch.Tensor, chunk_bytes: int
) -> dict[str, torch.Tensor]:
    """Same contract as :func:`~policy_probes.probes.fisher_generic.per_sample_squares`
    for a module :func:`gate_rule_applies` to; ``calls`` hold layouts made by
    ``batch_layout`` (input, then h_0 and c_0 for an LSTM)."""
    lstm = isinstance(module, nn.LSTM)
    per_call = []  # per call: the saved tensors of every (layer, direction) with gradients
    for call in calls:
        lay = call.layout
        x, h0 = lay.leaves[0], lay.leaves[1]
        c0 = lay.leaves[2] if lstm else None
        if module.batch_first:
            x = x.transpose(0, 1)
        with torch.enable_grad():
            # leaves that require grad: every pre-activation is then in the graph
            x, h0 = x.detach().requires_grad_(), h0.detach().requires_grad_()
            c0 = None if c0 is None else c0.detach().requires_grad_()
            out, h_n, c_n, saved = _rerun(module, x, h0, c0)
            g_out, g_h = call.grads[0], call.grads[1]
            g_c = call.grads[2] if lstm else None
            if g_out is not None and module.batch_first:
                g_out = g_out.transpose(0, 1)
            terms = []
            for y, g, bdim in ((out, g_out, 1), (h_n, g_h, 1), (c_n, g_c, 1)):
                if g is None or y is None:
                    continue
                shape = [1] * g.dim()
                shape[bdim] = -1
                terms.append((y * (g * w.to(g.dtype).view(shape))).sum())
            wanted = [t for s in saved for t in (s["ax"], *s["ah"])]
            grads = torch.autograd.grad(sum(terms), wanted, allow_unused=True)
        pos = 0
        for s in saved:
            s["dax"] = _zeros_if_none(grads[pos], s["ax"])
            s["dah"] = [
                _zeros_if_none(g, a) for g, a in zip(grads[pos + 1 :], s["ah"], strict=False)
            ]
            pos += 1 + len(s["ah"])
            # time order for the contractions: stacked (time, batch, .) tensors
            order = sorted(range(len(s["time"])), key=s["time"].__getitem__)
            s["dah"] = torch.stack([s["dah"][i] for i in order])
            s["prev"] = torch.stack([s["prev"][i] for i in order])
            del s["ax"], s["ah"]
        per_call.append(saved)
    n = w.shape[0]
    first = per_call[0]
    width = sum(s["dax"].shape[-1] * (s["x"].shape[-1] + s["prev"].shape[-1]) for s in first)
    acc: dict[str, torch.Tensor] = {}
    for lo, hi in chunks(n, 3 * width * w.element_size(), chunk_bytes):
        for j, s0 in enumerate(first):
            grads_ = {}
            for saved in per_call:
                s = saved[j]
                b = slice(lo, hi)
                pieces = {
                    "weight_ih": torch.einsum("tbg,tbi->bgi", s["dax"][:, b], s["x"][:, b]),
                    "weight_hh": torch.einsum("tbg,tbi->bgi", s["dah"][:, b], s["prev"][:, b]),
                }
                if module.bias:
                    pieces["bias_ih"] = s["dax"][:, b].sum(0)
                    pieces["bias_hh"] = s["dah"][:, b].sum(0)
                for k, v in pieces.items():
                    grads_[k] = grads_[k] + v if k in grads_ else v
            for k, v in grads_.items():
                name = k + s0["suffix"]
                sq = v.square().sum(0).to(SUM)
                acc[name] = acc[name].add_(sq) if name in acc else sq
    return acc


def _zeros_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
