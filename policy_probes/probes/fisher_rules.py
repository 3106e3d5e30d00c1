"""Closed-form per-sample Fisher rules of the layers policies use, applied at the drain.

The hook holds, per backward pass, the layer's input (for the norms: normalised) and
output gradient, one row per sample; :meth:`LayerRule.squares` gets them at the drain, the
gradient multiplied by each row's weight (the per-sample factor, 0 for a dropped row), and
returns ``sum_i (d l_i / d theta)^2`` per parameter, in chunks of samples whose
temporaries stay within ``chunk_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policy_probes.probes.state import SUM
from policy_probes.torch_internals import conv_padding

#: default bound on the temporaries of one chunk of samples (bytes) on accelerators
CHUNK_BYTES = 64 << 20
#: the same on the CPU: chunks that stay in a server CPU's last-level cache (about twice
#: as fast as 64 MiB on the NatureCNN's conv layers; docs/benchmarks.md)
CPU_CHUNK_BYTES = 8 << 20


def chunk_bytes_for(setting: int | None, device: torch.device) -> int:
    """The chunk bound in force: ``setting``, else :data:`CPU_CHUNK_BYTES` on the CPU and
    :data:`CHUNK_BYTES` elsewhere."""
    if setting is not None:
        return setting
    return CPU_CHUNK_BYTES if device.type == "cpu" else CHUNK_BYTES


Names = tuple[str | None, str | None]
#: what a layer kind holds of one pass: its rule, the rows for the drain, a shape key
Held = tuple["LayerRule", Tensor, str]


@contextmanager
def _no_tf32(x: Tensor) -> Iterator[None]:
    """cuDNN convolutions in full float32 while the block runs: its default allows TF32
    (10-bit mantissa), which would round the Fisher's sums like half precision."""
    if x.device.type != "cuda" or not torch.backends.cudnn.allow_tf32:
        yield
        return
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = True


def chunks(rows: int, per_sample_bytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` row ranges whose temporaries stay within ``chunk_bytes`` (min 1 row)."""
    step = max(1, chunk_bytes // max(per_sample_bytes, 1))
    for lo in range(0, rows, step):
        yield lo, min(lo + step, rows)


@dataclass(frozen=True)
class LayerRule:
    """Geometry of one layer and the names of its (weight, bias)."""

    names: Names

    def squares(self, x: Tensor, gw: Tensor, chunk_bytes: int) -> dict[str, Tensor]:
        """Per parameter, the sum over rows of the squared per-sample gradient, from the
        rows of the input ``x`` and of the weighted output gradient ``gw``."""
        raise NotImplementedError


def accumulate(acc: dict[str, torch.Tensor], name: str | None, value: torch.Tensor) -> None:
    """Add ``value`` to ``acc[name]`` (nothing when ``name`` is None); the first value is
    stored as a float64 copy, later ones added with (exact) type promotion."""
    if name is None:
        return
    if name in acc:
        acc[name].add_(value)
    else:
        acc[name] = value.to(SUM)


@dataclass(frozen=True)
class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``nn.Conv2d``. Per sample and group the weight gradient is
    ``dW[o, c, i, j] = sum_{p, q} g[o, p, q] * x[c, p*s + i*d, q*s + j*d]`` (``x`` the
    padded input, ``s`` the stride, ``d`` the dilation): a correlation of the input with
    the output gradient dilated by the stride, computed as one grouped convolution per
    chunk of samples (samples are the groups, input channels the batch, each sample's
    output gradient the kernel), read at every ``d``-th position: exact like im2col, and
    faster (docs/probes/fisher.md). The bias gradient: the output gradient's position sum."""

    in_shape: tuple[int, ...]  # (C, L) or (C, H, W) of one sample
    out_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    pad: tuple[int, ...]  # F.pad order (last dimension first), both sides
    pad_mode: str
    groups: int

    @classmethod
    def of(cls, conv: nn.Conv1d | nn.Conv2d, names: Names, x: Tensor, out: Tensor) -> ConvRule:
        """The rule of one pass: batched input ``x`` and output ``out``."""
        return cls(
            names,
            tuple(x.shape[1:]),
            tuple(out.shape[1:]),
            tuple(conv.weight.shape),
            tuple(conv.kernel_size),
            tuple(conv.stride),
            tuple(conv.dilation),
            conv_padding(conv),
            "constant" if conv.padding_mode == "zeros" else conv.padding_mode,
            conv.groups,
        )

    def squares(
        self, x: Tensor, gw: Tensor, chunk_bytes: int, method: str = "correlate"
    ) -> dict[str, Tensor]:
        """See :meth:`LayerRule.squares`. ``method``: ``"correlate"`` (the default) or
        ``"unfold"`` (im2col + einsum). Both are exact."""
        if method not in ("correlate", "unfold"):
            raise ValueError(f"method must be 'correlate' or 'unfold', got {method!r}")
        one_d = len(self.kernel) == 1
        g = _Geometry(
            kernel=(1, *self.kernel) if one_d else self.kernel,
            stride=(1, *self.stride) if one_d else self.stride,
            dilation=(1, *self.dilation) if one_d else self.dilation,
            out_hw=(1, *self.out_shape[1:]) if one_d else tuple(self.out_shape[1:]),
        )
        c_out = self.out_shape[0]
        correlate = method == "correlate"
        weight_squares = self._correlated if correlate else self._unfolded
        per_sample = x.element_size() * (
            self._correlation_bytes(g) if correlate else self._unfold_bytes(g)
        )
        acc: dict[str, torch.Tensor] = {}
        weight, bias = self.names
        for lo, hi in chunks(x.shape[0], per_sample, chunk_bytes):
            n = hi - lo
            gc = gw[lo:hi].view(n, c_out, *g.out_hw)
            if weight is not None:
                xc = x[lo:hi].view(n, *self.in_shape)
                if any(self.pad):
                    xc = F.pad(xc, self.pad, mode=self.pad_mode)
                if one_d:
                    xc = xc.unsqueeze(2)
                accumulate(acc, weight, weight_squares(xc, gc, g))
            if bias is not None:
                accumulate(acc, bias, gc.reshape(n, c_out, -1).sum(-1).square_().sum(0))
        return acc

    def _correlated(self, xc: Tensor, gc: Tensor, g: _Geometry) -> Tensor:
        """Σ over the chunk's samples of the squared weight gradients, by correlation:
        the (sample, group) pairs are the convolution's groups, the channels its batch."""
        n, groups, c_out = xc.shape[0], self.groups, self.out_shape[0]
        c_in, o_g = self.in_shape[0] // groups, c_out // groups
        inp = xc.reshape(n * groups, c_in, *xc.shape[2:]).transpose(0, 1)
        ker = gc.reshape(n * c_out, 1, *g.out_hw)
        with _no_tf32(inp):
            corr = F.conv2d(inp, ker, dilation=g.stride, groups=n * groups)
        (kh, kw), (dh, dw) = g.kernel, g.dilation
        taps = corr[..., : (kh - 1) * dh + 1 : dh, : (kw - 1) * dw + 1 : dw]
        sq = taps.square().reshape(c_in, n, groups, o_g, kh, kw).sum(1)
        # (c, group, o, kh, kw) -> the weight's (group * o, c, k...)
        return sq.permute(1, 2, 0, 3, 4).reshape(self.weight_shape)

    def _unfolded(self, xc: Tensor, gc: Tensor, g: _Geometry) -> Tensor:
        """The same by im2col (output gradient x input columns over positions)."""
        n, groups = xc.shape[0], self.groups
        positions, width = math.prod(g.out_hw), math.prod(self.weight_shape[1:])
        cols = F.unfold(xc, g.kernel, dilation=g.dilation, stride=g.stride)
        per = torch.einsum(
            "ngol,ngkl->ngok",
            gc.reshape(n, groups, -1, positions),
            cols.view(n, groups, width, positions),
        )
        return per.square_().sum(0).view(self.weight_shape)

    def _padded_hw(self) -> tuple[int, ...]:
        padded = [
            n + self.pad[2 * k] + self.pad[2 * k + 1] for k, n in enumerate(self.in_shape[:0:-1])
        ]
        return (1, *padded) if len(self.kernel) == 1 else tuple(reversed(padded))

    def _correlation_bytes(self, g: _Geometry) -> int:
        """Elements of one sample's temporaries on the correlation route."""
        padded = self._padded_hw()
        # the correlation's extent: every position a kernel tap can reach from position 0
        reach = tuple(h - (o - 1) * st for h, o, st in zip(padded, g.out_hw, g.stride, strict=True))
        c_in = self.in_shape[0]
        return (
            2 * c_in * math.prod(padded)  # padded, then contiguous input
            + self.out_shape[0] * math.prod(g.out_hw)
            + 2 * c_in * (self.out_shape[0] // self.groups) * math.prod(reach)
        )

    def _unfold_bytes(self, g: _Geometry) -> int:
        """Elements of one sample's temporaries on the im2col route."""
        positions, width = math.prod(g.out_hw), math.prod(self.weight_shape[1:])
        cols = self.in_shape[0] * math.prod(self.kernel) * positions
        return cols + 2 * self.out_shape[0] * width + math.prod(self.in_shape) * 2


@dataclass(frozen=True)
class _Geometry:
    """A convolution's geometry as 2-D (a Conv1d is an image of height 1)."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    out_hw: tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingRule(LayerRule):
    """``nn.Embedding``: the per-sample gradient of row k is the sum of the output
    gradients at the positions of that sample whose index is k (none at ``padding_idx``).
    Its square is formed without the (rows, num_embeddings, dim) tensor:
    ``sum_{l: idx_l = k} g_l * S_l`` with ``S_l = sum_{l': idx_l' = idx_l} g_l'``."""

    num_embeddings: int
    dim: int
    padding_idx: int | None

    def squares(self, x: Tensor, gw: Tensor, chunk_bytes: int) -> dict[str, Tensor]:
        positions = x.shape[1]
        per_sample = 4 * (positions * positions + 3 * positions * self.dim)
        out = torch.zeros(self.num_embeddings, self.dim, dtype=SUM, device=gw.device)
        for lo, hi in chunks(x.shape[0], per_sample, chunk_bytes):
            idx = x[lo:hi].long()
            gc = gw[lo:hi].view(hi - lo, positions, self.dim)
            if self.padding_idx is not None:
                gc = gc * (idx != self.padding_idx).to(gc.dtype)[..., None]
            same = (idx[:, :, None] == idx[:, None, :]).to(gc.dtype)
            per_row = torch.bmm(same, gc).mul_(gc)  # g_l * S_l
            out.index_add_(0, idx.reshape(-1), per_row.reshape(-1, self.dim).to(SUM))
        return {self.names[0]: out} if self.names[0] is not None else {}


@dataclass(frozen=True)
class NormRule(LayerRule):
    """``nn.LayerNorm`` (any ``normalized_shape``) and ``nn.GroupNorm``, from the
    normalised input ``xhat``: per sample ``d l / d w = sum_positions g * xhat`` and
    ``d l / d b = sum_positions g`` for each affine entry (LayerNorm: ``positions = 1``;
    GroupNorm: a channel's spatial positions)."""

    shape: tuple[int, ...]  # the affine parameters' shape
    positions: int

    def squares(self, x: Tensor, gw: Tensor, chunk_bytes: int) -> dict[str, Tensor]:
        weight, bias = self.names
        channels = math.prod(self.shape)
        per_sample = 3 * x.element_size() * channels * self.positions
        acc: dict[str, torch.Tensor] = {}
        for lo, hi in chunks(x.shape[0], per_sample, chunk_bytes):
            gc = gw[lo:hi].view(hi - lo, channels, self.positions)
            if weight is not None:
                gx = torch.mul(gc, x[lo:hi].view_as(gc)).sum(-1)
                accumulate(acc, weight, gx.square_().sum(0).view(self.shape))
            if bias is not None:
                accumulate(acc, bias, gc.sum(-1).square_().sum(0).view(self.shape))
        return acc


def _conv_rows(conv: nn.Conv1d | nn.Conv2d, names: Names, x: Tensor, out: Tensor) -> Held:
    if x.dim() == len(conv.kernel_size) + 1:  # unbatched input: one sample
        x, out = x.unsqueeze(0), out.unsqueeze(0)
    rule = ConvRule.of(conv, names, x, out)
    return rule, x.reshape(x.shape[0], -1), "x".join(map(str, x.shape[1:]))


def _embedding_rows(emb: nn.Embedding, names: Names, x: Tensor, out: Tensor) -> Held:
    rows = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(-1, 1)  # samples, positions
    rule = EmbeddingRule(names, emb.num_embeddings, emb.embedding_dim, emb.padding_idx)
    return rule, rows, str(rows.shape[1])


def _layer_norm_rows(norm: nn.LayerNorm, names: Names, x: Tensor, out: Tensor) -> Held:
    shape = tuple(norm.normalized_shape)  # samples: every leading dimension
    xhat = F.layer_norm(x, shape, eps=norm.eps)
    return NormRule(names, shape, 1), xhat.reshape(-1, math.prod(shape)), ""


def _group_norm_rows(norm: nn.GroupNorm, names: Names, x: Tensor, out: Tensor) -> Held:
    xhat = F.group_norm(x, norm.num_groups, eps=norm.eps)  # (N, C, *)
    positions = math.prod(x.shape[2:])
    rule = NormRule(names, (norm.num_channels,), positions)
    return rule, xhat.reshape(x.shape[0], -1), str(positions)


@dataclass(frozen=True)
class LayerKind:
    """How the Fisher reads one layer type: ``rows(module, names, x, out)`` gives a
    pass's :class:`LayerRule`, the rows to hold (input or normalised input, one per
    sample) and a key telling per-sample shapes apart (None for ``nn.Linear``: its input
    as is); ``positions(module, rows, out)`` the positions summed inside one sample."""

    name: str
    rows: Callable[..., Held] | None = None
    positions: Callable[[nn.Module, Tensor, Tensor], int] = lambda m, r, o: 1


_CONV = LayerKind(
    "conv", _conv_rows, lambda m, r, o: o.numel() // max(r.shape[0] * m.out_channels, 1)
)

#: module type -> how the Fisher reads it in closed form (BackPACK's module -> extension
#: table); a subclass counts when it keeps the type's ``forward``
LAYER_KINDS: dict[type[nn.Module], LayerKind] = {
    nn.Linear: LayerKind("linear"),
    nn.Conv1d: _CONV,
    nn.Conv2d: _CONV,
    nn.Embedding: LayerKind("embedding", _embedding_rows, lambda m, r, o: r.shape[1]),
    nn.LayerNorm: LayerKind("layer_norm", _layer_norm_rows),
    nn.GroupNorm: LayerKind(
        "group_norm", _group_norm_rows, lambda m, r, o: r.shape[1] // m.num_channels
    ),
}


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The closed-form reading of ``module``'s own parameters (:data:`LAYER_KINDS`); None
    for other types, an overridden ``forward`` or ``scale_grad_by_freq`` (batch-dependent)."""
    for cls in type(module).__mro__:
        kind = LAYER_KINDS.get(cls)
        if kind is not None:
            if type(module).forward is not cls.forward:
                return None
            return None if getattr(module, "scale_grad_by_freq", False) else kind
    return None
