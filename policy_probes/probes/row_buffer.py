"""RowBuffer: the sample rows a tracker has been shown and not yet reduced.

A hook call costs no tensor work at all: the buffer keeps a *reference* to each block the
hook saw (the activation or gradient autograd produced anyway) and its version counter.
When the tracker reduces, :meth:`RowBuffer.take` concatenates the held blocks once into
a preallocated storage of the tracker's own (one ``torch.cat`` per block column instead
of one copy per hook call), applies the per-push scale factors (one multiply per run of
equal factors) and releases the references. Several aligned blocks (for example a
layer's inputs and output gradients) share the row positions.

Held tensors are not copied, so an in-place change between the hook and the reduction
would be read instead of what the hook saw. Every block's ``_version`` is compared at
:meth:`take`; a changed one raises :class:`InPlaceModified`, and from then on the buffer
copies each push (``copy_pushes``), so later windows are exact again. The rows held are
bounded (``max_rows`` rows, ``max_elements`` elements), so memory does not grow with the
number of steps. Inference tensors (``torch.inference_mode``) have no version counter;
they are copied at the push.
"""

from __future__ import annotations

import torch

Layout = tuple[tuple[int, torch.dtype, torch.device], ...]


class InPlaceModified(RuntimeError):
    """A held block changed (in-place op) between the hook call and the reduction."""


class RowBuffer:
    """Aligned column blocks of at most ``max_rows`` rows and ``max_elements`` elements."""

    def __init__(self, max_elements: int, max_rows: int | None = None) -> None:
        self.max_elements = max_elements
        self.max_rows = max_rows
        self.pending: list[tuple[torch.Tensor, ...]] = []
        self.versions: list[tuple[int, ...] | None] = []
        self.segments: list[int] = []
        self.scales: list[tuple[float | None, ...] | None] = []
        self.rows = 0
        self.capacity = 0
        self.layout: Layout = ()
        #: the tracker's own copies of the rows, allocated once per layout at :meth:`take`
        self.storage: list[torch.Tensor] = []
        #: copy every push (set after an in-place change of a held block was detected)
        self.copy_pushes = False

    @staticmethod
    def _layout(blocks: tuple[torch.Tensor, ...]) -> Layout:
        return tuple((b.shape[1], b.dtype, b.device) for b in blocks)

    def accepts(self, blocks: tuple[torch.Tensor, ...]) -> bool:
        """True if ``blocks`` fit behind the rows already held, in the same layout."""
        if not self.rows:
            return self.reserve(blocks)
        return (
            self.rows + blocks[0].shape[0] <= self.capacity and self._layout(blocks) == self.layout
        )

    def reserve(self, blocks: tuple[torch.Tensor, ...]) -> bool:
        """Set an empty buffer's layout and capacity for ``blocks``; False if one push
        would not fit (or rows are still held)."""
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
            self.storage = []  # reallocated for the new layout at the next take()
            self.capacity, self.layout = capacity, layout
        return True

    def append(
        self, blocks: tuple[torch.Tensor, ...], scales: tuple[float | None, ...] | None
    ) -> None:
        if self.copy_pushes or any(b.is_inference() for b in blocks):
            # inference tensors have no version counter to check: hold a copy instead
            blocks = tuple(b.clone() for b in blocks)
            seen = None
        else:
            seen = tuple(b._version for b in blocks)
        self.pending.append(blocks)
        self.versions.append(seen)
        self.rows += blocks[0].shape[0]
        self.segments.append(blocks[0].shape[0])
        self.scales.append(scales)

    def take(self) -> tuple[tuple[torch.Tensor, ...], list[int]]:
        """The held rows as the buffer's own contiguous blocks, scaled, and the row count
        of every push; the buffer is empty afterwards. The blocks are overwritten by the
        next :meth:`take`, so the caller may reduce them in place."""
        pending, versions, segments, scales = (
            self.pending,
            self.versions,
            self.segments,
            self.scales,
        )
        rows = self.rows
        self.clear()
        for blocks, seen in zip(pending, versions, strict=True):
            if seen is not None and any(b._version != v for b, v in zip(blocks, seen, strict=True)):
                self.copy_pushes = True
                raise InPlaceModified(
                    "a probed tensor was modified in place after the probe read it (an in-place "
                    "op on a module output or its gradient), so this window's rows are lost; "
                    "the probe copies what it reads from now on. Use out-of-place ops on "
                    "probed outputs to keep the zero-copy path."
                )
        if not self.storage:
            self.storage = [
                torch.empty((self.capacity, w), dtype=d, device=dev) for w, d, dev in self.layout
            ]
        out = []
        for col, dst in enumerate(self.storage):
            block = dst[:rows]
            torch.cat([p[col] for p in pending], out=block)
            out.append(block)
        _apply_scales(out, segments, scales)
        return tuple(out), segments

    def clear(self) -> None:
        """Drop the held rows (the storage is kept for reuse)."""
        self.rows = 0
        self.pending = []
        self.versions = []
        self.segments = []
        self.scales = []

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer's own storage plus the held blocks it keeps alive."""
        own = sum(s.numel() * s.element_size() for s in self.storage)
        if not self.storage:  # not yet allocated: count what take() will allocate
            own = sum(
                self.capacity * w * torch.empty((), dtype=d).element_size()
                for w, d, _ in self.layout
            )
        held = sum(b.numel() * b.element_size() for p in self.pending for b in p)
        return own + held


def _apply_scales(
    blocks: list[torch.Tensor],
    segments: list[int],
    scales: list[tuple[float | None, ...] | None],
) -> None:
    """Multiply every push's rows by its scale, in place, one multiply per run of
    consecutive pushes with the same scales."""
    lo = 0
    run_lo, run_scales = 0, None
    for n, push_scales in [*zip(segments, scales, strict=True), (0, ())]:
        if push_scales != run_scales:
            for dst, s in zip(blocks, run_scales or (), strict=False):
                if s is not None and s != 1.0 and lo > run_lo:
                    dst[run_lo:lo].mul_(s)
            run_lo, run_scales = lo, push_scales
        lo += n
