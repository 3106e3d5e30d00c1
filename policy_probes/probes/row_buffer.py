"""RowBuffer: a fixed-size device buffer that hooks copy sample rows into.

A hook call costs one copy (or one multiply when the rows are scaled on the way in) and
no allocation; the tracker reduces the buffered rows in one go. Several aligned blocks
(for example a layer's inputs and output gradients) share the row positions.
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

    def _layout(
        self, blocks: tuple[torch.Tensor, ...]
    ) -> list[tuple[int, torch.dtype, torch.device]]:
        return [(b.shape[1], b.dtype, b.device) for b in blocks]

    def accepts(self, blocks: tuple[torch.Tensor, ...]) -> bool:
        """True if ``blocks`` fit behind the rows already buffered, in the same layout."""
        if not self.storage:
            return self.reserve(blocks)
        same = self._layout(blocks) == [(s.shape[1], s.dtype, s.device) for s in self.storage]
        return same and self.rows + blocks[0].shape[0] <= self.capacity

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
        if (
            layout != [(s.shape[1], s.dtype, s.device) for s in self.storage]
            or capacity != self.capacity
        ):
            self.storage = [torch.empty((capacity, w), dtype=d, device=dev) for w, d, dev in layout]
            self.capacity = capacity
        return True

    def append(
        self, blocks: tuple[torch.Tensor, ...], scales: tuple[float | None, ...] | None
    ) -> None:
        n = blocks[0].shape[0]
        lo, hi = self.rows, self.rows + n
        for i, (dst, src) in enumerate(zip(self.storage, blocks, strict=True)):
            scale = scales[i] if scales is not None else None
            if scale is None:
                dst[lo:hi].copy_(src)
            else:
                torch.mul(src, scale, out=dst[lo:hi])
        self.rows = hi
        self.segments.append(n)

    def blocks(self) -> tuple[torch.Tensor, ...]:
        return tuple(s[: self.rows] for s in self.storage)

    def clear(self) -> None:
        self.rows = 0
        self.segments = []

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.storage)
