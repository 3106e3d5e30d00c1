"""Exact per-sample Fisher of any parametrised module through ``torch.func``.

For a module without a closed-form rule (recurrent layers and cells,
``nn.MultiheadAttention``, user layers) the hook keeps the inputs of one pass and receives
the gradients of its outputs. The per-sample parameter gradient is the vector-Jacobian
product of sample i alone, ``d l_i / d theta = f * d <y_i, g_i> / d theta``, with the
module re-run on that sample's inputs: ``torch.func.vmap`` over ``torch.func.grad`` of
``torch.func.functional_call``, a chunk of samples at once. :func:`batch_layout` says
where every input's and output's batch dimension is, or raises :class:`ProbeError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.rnn import PackedSequence

from policy_probes.probes.fisher_rnn import gate_rule_applies, rnn_per_sample_squares
from policy_probes.probes.fisher_rules import accumulate, chunks
from policy_probes.torch_internals import (
    hooks_set_aside,
    tree_flatten,
    tree_flatten_cached,
    tree_leaves,
    tree_unflatten,
)
from policy_probes.user_errors import ProbeError


@dataclass
class Layout:
    """One pass of a module split into samples: the flattened ``(args, kwargs)`` leaves
    (implicit hidden states made explicit), each leaf's batch dimension (None: shared, or
    not a tensor) and each output leaf's (None: not a tensor)."""

    leaves: list[Any]
    spec: Any
    in_dims: list[int | None]
    out_dims: list[int | None]
    batch: int


def batch_layout(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Layout:
    """Where the samples are in one pass of ``module`` (see :class:`Layout`)."""
    seen = (*args, *kwargs.values(), *(output if isinstance(output, tuple) else (output,)))
    if any(isinstance(a, PackedSequence) for a in seen):
        raise ProbeError(
            f"{type(module).__name__} received a PackedSequence, which the generic Fisher "
            f"route cannot split into samples; pass padded tensors instead"
        )
    if module.training and _has_dropout(module):
        raise ProbeError(
            f"{type(module).__name__} applies dropout in training mode; re-run on single "
            f"samples it would draw new masks, so its per-sample gradients are not those of "
            f"the training pass. Set its dropout to 0 to cover it"
        )
    args, kwargs = tuple(args), dict(kwargs)
    if isinstance(module, nn.RNNBase | nn.RNNCellBase):
        return _rnn_layout(module, args, kwargs, output)
    if isinstance(module, nn.MultiheadAttention):
        return _attention_layout(module, args, kwargs, output)
    leaves, spec = tree_flatten_cached((args, kwargs))
    first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None:
        raise ProbeError(
            f"{type(module).__name__} received no tensor with a batch dimension; the generic "
            f"Fisher route needs inputs whose dimension 0 indexes samples"
        )
    n = first.shape[0]
    in_dims = [0 if _batched(t, n, 0) else None for t in leaves]
    out_dims = []
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad and not _batched(t, n, 0):
            raise ProbeError(
                f"{type(module).__name__} returned a tensor of shape {tuple(t.shape)} whose "
                f"dimension 0 is not the batch ({n}); the generic Fisher route needs every "
                f"output that carries gradient to be batched along dimension 0"
            )
        out_dims.append(0 if isinstance(t, torch.Tensor) else None)
    return Layout(leaves, spec, in_dims, out_dims, n)


def _has_dropout(module: nn.Module) -> bool:
    """Dropout with p > 0 anywhere in ``module`` (layers, stacked RNNs, attention)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1:
            return True
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            return True
    return False


def _batched(t: Any, n: int, dim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == n


def _rnn_layout(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Layout:
    cell = isinstance(module, nn.RNNCellBase)
    x = args[0] if args else kwargs.pop("input")
    hx = args[1] if len(args) > 1 else kwargs.pop("hx", None)
    if kwargs or len(args) > 2:
        raise ProbeError(f"{type(module).__name__} called with unexpected arguments {kwargs}")
    if x.dim() != (2 if cell else 3):
        raise ProbeError(
            f"{type(module).__name__} received an unbatched input of shape "
            f"{tuple(x.shape)}; the generic Fisher route needs a batch dimension"
        )
    bdim = 0 if cell or module.batch_first else 1
    hdim = 0 if cell else 1
    n = x.shape[bdim]
    if hx is None:  # the zeros the module would create, batched so vmap can split them
        if cell:
            shape = (n, module.hidden_size)
            cells = (shape, shape)
        else:
            layers = module.num_layers * (2 if module.bidirectional else 1)
            out = module.proj_size if getattr(module, "proj_size", 0) else module.hidden_size
            cells = ((layers, n, out), (layers, n, module.hidden_size))
        zeros = [torch.zeros(s, dtype=x.dtype, device=x.device) for s in cells]
        lstm = isinstance(module, nn.LSTM | nn.LSTMCell)
        hx = (zeros[0], zeros[1]) if lstm else zeros[1]
    # one call per step of a sequence: a spec built per call would outlive it (see
    # tree_flatten_cached)
    leaves, spec = tree_flatten_cached(((x, hx), {}))
    in_dims = [bdim] + [hdim] * (len(leaves) - 1)
    out_leaves = tree_leaves(output)
    out_dims = [hdim] * len(out_leaves)
    if not cell:
        out_dims[0] = bdim
    return Layout(leaves, spec, in_dims, out_dims, n)


_ATTENTION_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


def _attention_layout(
    module: nn.MultiheadAttention, args: tuple, kwargs: dict, output: Any
) -> Layout:
    named = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
    mask = named.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 3:
        raise ProbeError(
            "nn.MultiheadAttention received a per-sample 3-D attn_mask, which the generic "
            "Fisher route cannot split into samples; use key_padding_mask or a 2-D attn_mask"
        )
    bdim = 0 if module.batch_first else 1
    n = named["query"].shape[bdim]
    leaves, spec = tree_flatten_cached(((), named))
    dims = {"query": bdim, "key": bdim, "value": bdim, "key_padding_mask": 0}
    flat_names = tree_leaves(((), {k: k for k in named}))
    in_dims = [
        dims.get(k) if isinstance(v, torch.Tensor) else None
        for k, v in zip(flat_names, leaves, strict=True)
    ]
    out_dims = [bdim, 0] if isinstance(output[1], torch.Tensor) else [bdim, None]
    return Layout(leaves, spec, in_dims, out_dims[: len(tree_leaves(output))], n)


class OutputTap(torch.autograd.Function):
    """Identity on the output tensors of one pass, as copies from one node whose backward
    hands all their gradients (None where none flowed) to ``callback``; being copies,
    in-place ops on them downstream do not hide those gradients."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.callback(grads)
        return (None, *grads)


@dataclass
class Call:
    """One pass of the module whose output gradients arrived: ``layout`` (inputs split
    into samples) and the gradient of every output leaf (None: none)."""

    layout: Layout
    grads: list[torch.Tensor | None]
    #: the row-mask entries of its samples (None: no mask), see RowMask.per_sample
    weight: torch.Tensor | None = None
    #: rows of its first output read as (rows, features), as a Linear on it reads them
    #: (an nn.LSTM's steps x sequences); None: one per sample
    rows: int | None = None


def per_sample_squares(
    module: nn.Module, calls: Sequence[Call], w: torch.Tensor, chunk_bytes: int
) -> dict[str, torch.Tensor]:
    """``sum_i w_i^2 (sum_calls d <y_i, g_i> / d theta)^2`` for every parameter of
    ``module`` (``w``: one weight per sample, 0 for a dropped one). ``calls`` are the
    passes of one backward over the same samples (a cell stepped over time). Recurrent
    layers take the faster, equally exact rule of :mod:`~policy_probes.probes.fisher_rnn`."""
    if gate_rule_applies(module):
        return rnn_per_sample_squares(module, calls, w, chunk_bytes)
    params = {k: p.detach() for k, p in module.named_parameters()}
    # copies of the buffers: a forward that updates one in place updates the copy
    buffers = {k: b.clone() for k, b in module.named_buffers()}
    n = calls[0].layout.batch
    plans = []  # per call: leaves, batched leaf positions, gradient positions, scaled grads
    for call in calls:
        lay = call.layout
        scaled: list[torch.Tensor | None] = []
        for g, d in zip(call.grads, lay.out_dims, strict=True):
            if g is None or d is None:
                scaled.append(None)
                continue
            shape = [1] * g.dim()
            shape[d] = -1
            scaled.append(g * w.to(g.dtype).view(shape))  # vjp is linear in g: w_i scales i
        batched_at = [i for i, d in enumerate(lay.in_dims) if d is not None]
        g_at = [i for i, g in enumerate(scaled) if g is not None]
        plans.append((lay, batched_at, g_at, scaled))

    def sample_loss(p: dict, xs: list[list[torch.Tensor]], gs: list[list[torch.Tensor]]):
        total = None
        for (lay, batched_at, g_at, _), x_call, g_call in zip(plans, xs, gs, strict=True):
            leaves = list(lay.leaves)
            for i, x in zip(batched_at, x_call, strict=True):
                leaves[i] = x.unsqueeze(lay.in_dims[i])  # a batch of one sample
            args, kwargs = tree_unflatten(leaves, lay.spec)
            outs = tree_flatten(functional_call(module, (p, buffers), args, kwargs))[0]
            for i, g in zip(g_at, g_call, strict=True):
                term = (outs[i] * g.unsqueeze(lay.out_dims[i])).sum()
                total = term if total is None else total + term
        return total

    x_dims = [[lay.in_dims[i] for i in batched_at] for lay, batched_at, _, _ in plans]
    g_dims = [[lay.out_dims[i] for i in g_at] for lay, _, g_at, _ in plans]
    per_grad = vmap(grad(sample_loss), in_dims=(None, x_dims, g_dims))
    numel = sum(p.numel() for p in params.values())
    data = sum(
        sum(lay.leaves[i].numel() for i in batched_at) + sum(sc[i].numel() for i in g_at)
        for lay, batched_at, g_at, sc in plans
    )
    element = next(iter(params.values())).element_size()
    per_sample = element * (3 * numel + 8 * data // max(n, 1))
    acc: dict[str, torch.Tensor] = {}
    with _unbatched_backends(), hooks_set_aside(module):
        for lo, hi in chunks(n, per_sample, chunk_bytes):
            xs = [
                [lay.leaves[i].narrow(lay.in_dims[i], lo, hi - lo) for i in batched_at]
                for lay, batched_at, _, _ in plans
            ]
            gs = [
                [sc[i].narrow(lay.out_dims[i], lo, hi - lo) for i in g_at]
                for lay, _, g_at, sc in plans
            ]
            for name, g in per_grad(params, xs, gs).items():
                accumulate(acc, name, g.square().sum(0))
    return acc


class _unbatched_backends:
    """oneDNN and cuDNN off while vmap runs (their fused RNN kernels have no batching
    rule); the user's settings restored on exit."""

    def __enter__(self) -> None:
        self.saved = (torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled)
        torch.backends.mkldnn.enabled = False
        torch.backends.cudnn.enabled = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled = self.saved


def row_finite(tensors: Sequence[tuple[torch.Tensor, int]], n: int) -> torch.Tensor:
    """1.0 for each of the ``n`` samples whose entries are finite in every
    ``(tensor, batch dim)``, else 0.0 (float ops only, no host transfer)."""
    bad = None
    for t, d in tensors:
        if not t.is_floating_point():
            continue
        per = torch.sub(t, t).nan_to_num_(1.0, 1.0, 1.0).movedim(d, 0).reshape(n, -1).sum(1)
        bad = per if bad is None else bad.add_(per)
    if bad is None:
        return torch.ones(n, device=tensors[0][0].device if tensors else None)
    return bad.sign_().neg_().add_(1.0)


def clean(t: Any) -> Any:
    """A float tensor detached, its non-finite entries 0 (a dropped sample's zero weight
    must not meet NaN); anything else as is."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        return torch.nan_to_num(t, 0.0, 0.0, 0.0) if t.is_floating_point() else t
    return t
