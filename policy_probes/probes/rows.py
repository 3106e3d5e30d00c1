"""Drained rows, materialised once and shared by every probe that reads the same tensors.

Several probes often read the very same tensors (an MLP's output, its gradient), so the
trackers of a context drain together (:class:`DrainRound`): a block column held by several
is materialised once, its squares, positive indicators and counts computed at most once.
Float arithmetic only (``x - x`` is NaN exactly where ``x`` is not finite; bool ops cost
several times more on the CPU); half precision is widened to float32, keeping sums exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: per-column counts are exact int64 (float32 sums of 0/1 are exact below 2**24, far
#: above a buffer's capacity)
COUNT = torch.int64


class Rows:
    """One block column of drained rows, ``(N, U)``: :attr:`clean` (non-finite entries
    replaced by 0) and :attr:`nonfinite` (1.0 at those entries), read-only (probes share
    them); derived quantities are cached on first use in the storage ``aux(slot)`` gives."""

    def __init__(
        self,
        clean: torch.Tensor,
        nonfinite: torch.Tensor | None,
        aux: Callable[[int], torch.Tensor],
    ) -> None:
        self.clean = clean
        #: every entry is known finite (:meth:`finite`): counts need no reading
        self.all_finite = nonfinite is None
        self._nonfinite = nonfinite
        self._aux = aux
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def nonfinite(self) -> torch.Tensor:
        """1.0 at the entries that were not finite, else 0.0 (a broadcast zero when known)."""
        if self._nonfinite is None:
            self._nonfinite = self.clean.new_zeros(()).expand(self.clean.shape)
        return self._nonfinite

    @classmethod
    def split(
        cls, values: torch.Tensor, nonfinite: torch.Tensor, aux: Callable[[int], torch.Tensor]
    ) -> Rows:
        """Split materialised ``values`` **in place** into finite values and an indicator
        written into ``nonfinite`` (same shape)."""
        torch.sub(values, values, out=nonfinite).nan_to_num_(1.0, 1.0, 1.0)
        values.nan_to_num_(0.0, 0.0, 0.0)
        return cls(values, nonfinite, aux)

    @classmethod
    def copied(
        cls,
        held: torch.Tensor,
        values: torch.Tensor,
        nonfinite: torch.Tensor,
        aux: Callable[[int], torch.Tensor],
    ) -> Rows:
        """Rows of one contiguous held block of the storage's dtype (``(N, U)``, or
        ``(B, *spatial, U)`` of N rows), copied into ``values`` with non-finite entries
        replaced by 0, and ``nonfinite`` 1.0 where they were: two passes where a
        :meth:`split` of a concatenation takes four (not for strided views: reading one
        twice costs more than that saves)."""
        shaped = values.view(held.shape)
        torch.nan_to_num(held, 0.0, 0.0, 0.0, out=shaped)
        torch.ne(held, shaped, out=nonfinite.view(held.shape))  # where a value was replaced
        return cls(values, nonfinite, aux)

    @classmethod
    def finite(cls, values: torch.Tensor, aux: Callable[[int], torch.Tensor]) -> Rows:
        """Rows of ``values`` known to be all finite, read where they lie (not copied)."""
        return cls(values, None, aux)

    @property
    def num_rows(self) -> int:
        return self.clean.shape[0]

    def _cached(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = compute()
        return t

    def finite_count(self) -> torch.Tensor:
        """Finite entries per column (int64)."""
        if self.all_finite:
            return self._cached("finite_count", self._full_count)
        return self._cached("finite_count", lambda: self.num_rows - self.nonfinite_count())

    def nonfinite_count(self) -> torch.Tensor:
        """Non-finite entries per column (int64)."""
        if self.all_finite:
            return self._cached(
                "nonfinite_count",
                lambda: torch.zeros(self.clean.shape[1:], dtype=COUNT, device=self.clean.device),
            )
        return self._cached("nonfinite_count", lambda: column_counts(self.nonfinite))

    def _full_count(self) -> torch.Tensor:
        clean = self.clean
        return torch.full(clean.shape[1:], clean.shape[0], dtype=COUNT, device=clean.device)

    def nonfinite_total(self) -> torch.Tensor:
        """Non-finite entries in all (int64 scalar)."""
        if self.all_finite:
            return self._cached(
                "nonfinite_total",
                lambda: torch.zeros((), dtype=COUNT, device=self.clean.device),
            )
        return self._cached(
            "nonfinite_total", lambda: self.clean.numel() - self.finite_count().sum()
        )

    def square(self) -> torch.Tensor:
        """``clean ** 2``."""
        return self._cached("square", lambda: torch.mul(self.clean, self.clean, out=self._aux(0)))

    def positive(self) -> torch.Tensor:
        """1.0 where the value is finite and > 0, else 0.0."""
        return self._cached(
            "positive", lambda: torch.sign(self.clean, out=self._aux(1)).clamp_(min=0.0)
        )

    def row_nonfinite(self) -> torch.Tensor:
        """Non-finite entries per row (float, exact)."""
        if self.all_finite:
            return self._cached("row_nonfinite", lambda: self.clean.new_zeros(self.num_rows))
        return self._cached("row_nonfinite", lambda: self.nonfinite.sum(1))


class DrainRound:
    """The materialised columns of one drain, keyed by the held tensors' data pointers
    (a hit must agree on device, dtype, shape and strides too); the round keeps the held
    tensors alive, so no key's memory is reused meanwhile."""

    def __init__(self) -> None:
        self._rows: dict[tuple[int, ...], tuple[Rows, Sequence[torch.Tensor]]] = {}

    def rows(self, refs: Sequence[torch.Tensor], materialise: Callable[[], Rows]) -> Rows:
        """The round's :class:`Rows` of ``refs``, made by ``materialise()`` the first time
        (and again, unshared, for a key whose views differ)."""
        key = tuple(t.data_ptr() for t in refs)
        hit = self._rows.get(key)
        if hit is not None and all(map(_same_view, refs, hit[1])):
            return hit[0]
        made = materialise()
        self._rows.setdefault(key, (made, refs))
        return made


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def column_counts(indicators: torch.Tensor) -> torch.Tensor:
    """Per-column sum of a 0/1 float matrix as exact int64 counts."""
    return indicators.sum(0).to(COUNT)
