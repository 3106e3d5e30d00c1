"""RowBuffer: a fixed-size device buffer that hooks copy sample rows into.

A hook call costs one copy per block and no allocation; the tracker reduces the buffered
rows in one go. Several aligned blocks (for example a layer's inputs and output
gradients) share the row positions. Per-push scale factors are remembered and applied at
:meth:`RowBuffer.apply_scales`, one multiply per run of pushes with the same factor
(usually one per flush) instead of one per push.
"""

from __future__ import annotations

import torch


class RowBuffer:
    """Aligned column blocks of at most ``max_rows`` rows and ``max_elements`` elements."""

    def __init__(self, max_elements: int, max_rows: int | None = None) -> None:
        self.max_elements = max_elements
        self.max_rows = max_rows
        self.storage: list[torch.Tensor] = []
        self.capacity = 0
        self.rows = 0
        self.segments: list[int] = []
        self.scales: list[tuple[float | None, ...] | None] = []
        self.layout: tuple[tuple[int, torch.dtype, torch.device], ...] = ()

    @staticmethod
    def _layout(
        blocks: tuple[torch.Tensor, ...],
    ) -> tuple[tuple[int, torch.dtype, torch.device], ...]:
        return tuple((b.shape[1], b.dtype, b.device) for b in blocks)

    def accepts(self, blocks: tuple[torch.Tensor, ...]) -> bool:
        """True if ``blocks`` fit behind the rows already buffered, in the same layout."""
        if not self.storage:
            return self.reserve(blocks)
        return (
            self.rows + blocks[0].shape[0] <= self.capacity and self._layout(blocks) == self.layout
        )

    def reserve(self, blocks: tuple[torch.Tensor, ...]) -> bool:
        """(Re)allocate an empty buffer for this layout; False if one push would not fit."""
        if self.rows:
            return False
        width = sum(b.shape[1] for b in blocks)
        capacity = self.max_elements // max(width, 1)
        if self.max_rows is not None:
            capacity = min(capacity, self.max_rows)
        if blocks[0].shape[0] > capacity:
            return False
        layout = self._layout(blocks)
        if layout != self.layout or capacity != self.capacity:
            self.storage = [torch.empty((capacity, w), dtype=d, device=dev) for w, d, dev in layout]
            self.capacity = capacity
            self.layout = layout
        return True

    def append(
        self, blocks: tuple[torch.Tensor, ...], scales: tuple[float | None, ...] | None
    ) -> None:
        n = blocks[0].shape[0]
        lo, hi = self.rows, self.rows + n
        for dst, src in zip(self.storage, blocks, strict=True):
            dst[lo:hi].copy_(src)
        self.rows = hi
        self.segments.append(n)
        self.scales.append(scales)

    def apply_scales(self) -> None:
        """Multiply every pushed block by its push's scale, in place, one multiply per run
        of consecutive pushes with the same scales."""
        lo = 0
        run_lo, run_scales = 0, None
        for n, scales in [*zip(self.segments, self.scales, strict=True), (0, ())]:
            if scales != run_scales:
                for dst, s in zip(self.storage, run_scales or (), strict=False):
                    if s is not None and s != 1.0 and lo > run_lo:
                        dst[run_lo:lo].mul_(s)
                run_lo, run_scales = lo, scales
            lo += n
        self.scales = [None] * len(self.segments)

    def blocks(self) -> tuple[torch.Tensor, ...]:
        return tuple(s[: self.rows] for s in self.storage)

    def clear(self) -> None:
        self.rows = 0
        self.segments = []
        self.scales = []

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.storage)
