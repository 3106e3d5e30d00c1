"""Gradient-flow probe: how much gradient reaches each output unit of a component.

Per backward pass p, per unit u, the RMS over samples of the output gradient as autograd
delivers it: r_u(p) = sqrt(mean_i g_iu^2). Across the passes of the window an exponential
moving average m_u = beta m_u + (1 - beta) r_u(p), bias-corrected by 1 - beta^k after k
passes (as in Adam), smooths minibatch noise while following trends within an epoch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from policy_probes.plugins import register
from policy_probes.probes.layout import as_unit_rows
from policy_probes.probes.per_layer import PerLayerProbe, ProbedLayer
from policy_probes.probes.rows import COUNT, Rows
from policy_probes.probes.state import Drained
from policy_probes.probes.weighted import Weighted

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

BLOCKED_THRESHOLD = 1e-8


@register
class GradientFlow(PerLayerProbe):
    """Bias-corrected EMA of per-unit gradient RMS across the backward passes of a window
    (``ema`` and ``passes`` are averaged across processes, which run as many passes)."""

    mirrors_identical_rows = True  # consume() writes the accumulators only
    batch_units = True  # per-unit accumulators from per-column reductions

    name = "gradient_flow"
    maker = "attach_gradient_flow_hooks()"
    direction = "backward"
    events = ("backward",)
    docs = "docs/probes/gradient_flow.md"
    metrics = {
        "rms": "per unit: EMA of the RMS of its output gradient over the passes",
        "mean": "mean of rms over the units",
        "blocked_fraction": "share of units whose rms is below blocked_threshold",
    }
    console = ("mean",)
    mean_reduced = frozenset({"ema", "passes"})

    def __init__(self, beta: float = 0.95, *, blocked_threshold: float = BLOCKED_THRESHOLD) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must lie in [0, 1), got {beta}")
        super().__init__(beta=beta, blocked_threshold=blocked_threshold)

    def update(
        self,
        component: str,
        grad_output: torch.Tensor,
        channels_first: bool = False,
        *,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Add one backward pass (one gradient delivery); under a row mask the deliveries of
        one ``row_mask`` block are one pass (an LSTM stepped over time: scale = its serial)."""
        mask = self.context.row_mask if self.context is not None else None
        scales = None if mask is None else (mask.serial,)
        rows = as_unit_rows(grad_output, channels_first)
        self._push(component, "g", (rows,), scales, weight)

    def consume(self, batch: Drained) -> None:
        component, (drained,), weight = batch.component, batch.cols, batch.weight
        beta = self.settings[component]["beta"]
        g = drained.clean
        sq = drained.square()
        segments = _passes(batch.segments, batch.scales)
        if weight is not None:
            self._consume_masked(component, drained, segments, weight, beta)
            return
        # finite samples per pass and unit = rows of the pass - its non-finite entries
        if len(set(segments)) == 1:  # equal passes: one reshape, no loop
            p, n = len(segments), segments[0]
            sums = sq.reshape(p, n, -1).sum(1)
            if drained.all_finite:
                counts = torch.full_like(sums, n)
            else:
                counts = drained.nonfinite.reshape(p, n, -1).sum(1).neg_().add_(n)
        else:
            sums = torch.stack([part.sum(0) for part in sq.split(segments)])
            counts = torch.stack(
                [
                    part.sum(0).neg_().add_(n)
                    for n, part in zip(segments, drained.nonfinite.split(segments), strict=True)
                ]
            )
        rms = (sums.to(torch.float64) / counts.to(torch.float64).clamp(min=1)).sqrt()
        # m <- beta^P m + sum_p (1 - beta) beta^(P-1-p) r_p : the EMA over these P passes
        p = rms.shape[0]
        weights = (1.0 - beta) * beta ** torch.arange(
            p - 1, -1, -1, dtype=torch.float64, device=g.device
        )
        ema = self._acc(component, "ema", rms[0], torch.float64)
        ema.mul_(beta**p).add_(weights @ rms)
        self._acc(component, "passes", rms[0], torch.float64).add_(float(p))  # per unit
        finite = counts.sum(0).to(COUNT)
        self._add(component, "nonfinite", g.shape[0] - finite, COUNT)
        self._add(component, "count", finite, COUNT)

    def _consume_masked(
        self, component: str, drained: Rows, segments: list[int], weight: torch.Tensor, beta: float
    ) -> None:
        """:meth:`consume` under a row mask: each pass's RMS is over its kept rows, and a
        pass whose rows are all masked leaves the EMA and ``passes`` unchanged."""
        w = weight.to(drained.clean.dtype)[:, None]
        sq = torch.mul(drained.square(), w, out=self.scratch(drained.clean))
        nonfinite = torch.mul(drained.nonfinite, w, out=self.scratch(drained.clean, 1))
        kept = Weighted(drained, weight).segment_sums(segments)  # kept rows per pass
        sums = torch.stack([part.sum(0) for part in sq.split(segments)]).to(torch.float64)
        bad = torch.stack([part.sum(0) for part in nonfinite.split(segments)])
        counts = bad.to(torch.float64).neg_().add_(kept[:, None])
        rms = (sums / counts.clamp(min=1)).sqrt()
        valid = kept.sign()  # 1 for a pass with a kept row
        later = valid.flip(0).cumsum(0).flip(0).sub_(valid)  # counted passes after each
        weights = torch.pow(beta, later).mul_(valid).mul_(1.0 - beta)
        ema = self._acc(component, "ema", rms[0], torch.float64)
        ema.mul_(torch.pow(beta, valid.sum())).add_(weights @ rms)
        self._acc(component, "passes", rms[0], torch.float64).add_(valid.sum())
        finite = counts.sum(0).round_().to(COUNT)
        self._add(component, "nonfinite", kept.sum().round_().to(COUNT) - finite, COUNT)
        self._add(component, "count", finite, COUNT)

    def record_layer(
        self, obs: Observation, layer: ProbedLayer, output: torch.Tensor, weight: Any
    ) -> None:
        """Subscribe to the gradient of ``layer``'s output, with its row-mask rows."""
        if not (output.requires_grad and torch.is_grad_enabled()):
            return

        def compute(grad: torch.Tensor, weight: Any, loss_scale: Any) -> None:
            self.update(layer.component, grad, layer.channels_first, weight=weight)

        obs.tap(output, weight, compute)

    def summarize_alike(
        self, components: list[str], s: dict[str, torch.Tensor], cfg: dict[str, Any]
    ) -> list[dict]:
        parts = len(components)  # numpy, each layer's units in one row: see ReLUActivation
        passes = s["passes"].numpy().reshape(parts, -1)
        ks = [float(row[0]) if row.size else 0.0 for row in passes]
        corrections = [1.0 - cfg["beta"] ** k if k > 0 else 1.0 for k in ks]
        rms = s["ema"].numpy().reshape(parts, -1) / np.array(corrections)[:, None]
        finite = s["count"].numpy().reshape(parts, -1).sum(1).tolist()
        nonfinite = s["nonfinite"].numpy().reshape(parts, -1).sum(1).tolist()
        means = rms.mean(1).tolist()
        lows = rms.min(1, initial=np.inf).tolist()
        blocked = np.count_nonzero(rms < cfg["blocked_threshold"], axis=1).tolist()
        out = []
        for i in range(parts):
            elements = finite[i] + nonfinite[i]
            units = rms.shape[1]
            out.append(
                {
                    "rms": rms[i].tolist(),
                    "mean": means[i] if units else math.nan,
                    "min": lows[i] if units else math.nan,
                    "blocked_fraction": blocked[i] / units if units else math.nan,
                    "passes": ks[i],
                    "nonfinite_fraction": (elements - finite[i]) / elements if elements else 0.0,
                }
            )
        return out


def _passes(segments: list[int], scales: list[Any]) -> list[int]:
    """Rows per pass: consecutive pushes of one ``row_mask`` block are one pass."""
    out: list[int] = []
    previous = None
    for n, scale in zip(segments, scales, strict=True):
        block = None if scale is None else scale[0]
        if block is not None and block == previous:
            out[-1] += n
        else:
            out.append(n)
        previous = block
    return out


def attach_gradient_flow_hooks(
    beta: float = 0.95, *, blocked_threshold: float = BLOCKED_THRESHOLD
) -> GradientFlow:
    """The ``gradient_flow`` probe (:class:`GradientFlow`): the EMA (``beta``) of each
    output unit's gradient RMS. Placed with every placement argument."""
    return GradientFlow(beta, blocked_threshold=blocked_threshold)
