"""Column reductions of drained rows weighted by a row mask (see :mod:`policy_probes.row_mask`).

Under a row mask a tracker's column sums and counts are over the kept rows only;
:class:`Weighted` gives both forms behind one interface (without a mask exactly the
unweighted code, cached counts included).
"""

from __future__ import annotations

import torch

from policy_probes.probes.rows import COUNT, Rows, column_counts


class Weighted:
    """Column reductions of drained rows weighted by the rows' mask entries ``weight``
    (``(N,)`` of 0/1, or None for all rows): sums over kept rows, counts of kept rows."""

    def __init__(self, rows: Rows, weight: torch.Tensor | None) -> None:
        self.rows = rows
        self.weight = weight

    @property
    def num_rows(self) -> int | torch.Tensor:
        """Kept rows (an int without a mask)."""
        if self.weight is None:
            return self.rows.num_rows
        return self.weight.sum().to(COUNT)

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-column sum over kept rows of ``x`` (N, U)."""
        w = self.weight
        if w is None:
            return x.sum(0)
        return torch.mv(x.T, w if w.dtype == x.dtype else w.to(x.dtype))

    def counts(self, indicators: torch.Tensor) -> torch.Tensor:
        """Per-column number of kept rows where a 0/1 ``indicators`` is 1 (int64)."""
        if self.weight is None:
            return column_counts(indicators)
        return self.sums(indicators).round_().to(COUNT)

    def finite_count(self) -> torch.Tensor:
        """Finite entries per column among kept rows (int64)."""
        if self.weight is None:
            return self.rows.finite_count()
        return self.num_rows - self.counts(self.rows.nonfinite)

    def nonfinite_counts(self) -> torch.Tensor:
        """Non-finite entries per column among kept rows (int64)."""
        if self.weight is None:
            return self.rows.nonfinite_count()
        return self.counts(self.rows.nonfinite)

    def nonfinite_total(self) -> torch.Tensor:
        """Non-finite entries among kept rows (int64 scalar)."""
        if self.weight is None:
            return self.rows.nonfinite_total()
        return self.counts(self.rows.nonfinite).sum()

    def segment_sums(self, segments: list[int]) -> torch.Tensor:
        """Kept rows per push (float64, ``(len(segments),)``)."""
        assert self.weight is not None
        w = self.weight.to(torch.float64)
        if len(set(segments)) == 1:
            return w.reshape(len(segments), -1).sum(1)
        return torch.stack([part.sum() for part in w.split(segments)])
