"""Diagonal empirical Fisher information of a component (backward probe).

The empirical Fisher of a parameter theta is the mean over samples of the squared
per-sample gradient, F = (1/N) sum_i (d l_i / d theta)^2. Training losses are means over
the minibatch, L = c * (1/n) sum_i l_i, where c is ``context.loss_scale`` (1 unless the
loop scales the loss, e.g. for gradient accumulation). Autograd delivers
g_i = dL/dy_i = (c/n) dl_i/dy_i, so the per-sample gradient is (n/c) g_i. With
``loss_reduction="sum"`` (L = c * sum_i l_i) it is g_i / c.

Per-parameter Fisher is computed exactly from cached layer inputs, never from
per-sample gradient tensors and never from ``param.grad``:

* ``nn.Linear`` (y = x W^T + b): F_W = f^2 sum_i (g_i^2)^T (x_i^2) / N, F_b = f^2 sum_i g_i^2 / N
* ``nn.LayerNorm`` over the last dimension: F_w = f^2 sum_i (g_i * xhat_i)^2 / N,
  F_b = f^2 sum_i g_i^2 / N, with xhat the normalised input

where f is the per-sample factor above. Parameters of other module types inside the
component are not covered; they are counted in ``unsupported_params`` and a warning
names them when the probe is attached.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.context import ComponentContext
from policy_probes.grad_tap import on_grad
from policy_probes.hook_types import BackwardHookBuilder, Extractor, ProbeHook
from policy_probes.probes.rows import COUNT, Rows
from policy_probes.probes.state import SUM, ProbeState, as_floats, as_rows, get_state, rates

log = logging.getLogger("policy_probes")

DEAD_PARAM_THRESHOLD = 1e-8


class FisherInformationState(ProbeState):
    """Sums of squared per-sample gradients: per output unit and per parameter entry."""

    probe = "fisher"

    def register_component(
        self,
        name: str,
        *,
        loss_reduction: str = "mean",
        dead_threshold: float = DEAD_PARAM_THRESHOLD,
        **extra: Any,
    ) -> bool:
        return super().register_component(
            name, loss_reduction=loss_reduction, dead_threshold=dead_threshold, **extra
        )

    def sample_factor(self, component: str, rows: int, loss_scale: float) -> float:
        """Factor turning the autograd gradient of one row into its per-sample gradient."""
        scale = loss_scale if loss_scale else 1.0
        if self.settings[component]["loss_reduction"] == "sum":
            return 1.0 / scale
        return rows / scale

    def update(self, component: str, grad_output: torch.Tensor, loss_scale: float = 1.0) -> None:
        """Per-unit Fisher of the component output from one backward pass."""
        g = as_rows(grad_output)
        f = self.sample_factor(component, g.shape[0], loss_scale)
        self._push(component, "out", (g,), (f,))

    def update_layer(
        self,
        component: str,
        kind: str,
        names: tuple[str | None, str | None],
        x: torch.Tensor,
        grad_output: torch.Tensor,
        loss_scale: float = 1.0,
    ) -> None:
        """One backward pass through a covered layer: its input (for ``nn.LayerNorm`` the
        normalised input) and output gradient; ``names`` = (weight, bias) names or None."""
        g = as_rows(grad_output)
        f = self.sample_factor(component, g.shape[0], loss_scale)
        stream = f"{kind}:{names[0] or ''}:{names[1] or ''}"
        self._push(component, stream, (as_rows(x), g), (None, f))

    def consume(
        self,
        component: str,
        stream: str,
        cols: tuple[Rows, ...],
        segments: list[int],
        scales: list[Any],
    ) -> None:
        g = cols[-1]
        # w: every row's per-sample factor f (the gradient block's push scale)
        w = self.scratch(g.clean[:, 0], 1)
        lo = 0
        for f, run in itertools.groupby(zip(segments, scales, strict=True), key=_factor):
            hi = lo + sum(n for n, _ in run)
            w[lo:hi].fill_(f)
            lo = hi
        if stream == "out":
            # sum_i (f_i g_i)^2 per unit: one matrix-vector product with f^2
            unit_sq = torch.mv(g.square().T, w.square_()).to(SUM)
            self._add(component, "unit_sq", unit_sq)
            self._add(component, "unit_count", g.finite_count(), COUNT)
            self._add(component, "nonfinite", g.nonfinite_total(), COUNT)
            return
        kind, weight, bias = stream.split(":")
        x = cols[0]
        # Drop whole samples with a non-finite input or gradient: the row weight is 0 for
        # a row with any non-finite entry (x.clean and g.clean are finite).
        ok = torch.add(x.row_nonfinite(), g.row_nonfinite()).sign_().neg_().add_(1.0)
        w.mul_(ok)
        gs = torch.mul(g.clean, w[:, None], out=self.scratch(g.clean, 1))  # f g, 0 if dropped
        sq = {}
        if kind == "layer_norm" and weight:  # d l / d w = g * xhat elementwise
            gx = torch.mul(gs, x.clean, out=self.scratch(x.clean, 0))
            sq[weight] = gx.square_().sum(0).to(SUM)
        g2 = gs.square_()
        if kind == "linear":
            sq[weight] = (g2.T @ x.square()).to(SUM)
        if bias:
            sq[bias] = g2.sum(0).to(SUM)
        samples = ok.sum().to(COUNT)
        for name, value in sq.items():
            self._add(component, f"param:{name}", value)
            self._add(component, f"param_samples:{name}", samples, COUNT)

    def param_fisher(self, component: str) -> dict[str, torch.Tensor]:
        """Per-entry diagonal Fisher of every covered parameter for the current window, on
        the host (for analysis; :meth:`to_metrics` reports summaries)."""
        self.flush()
        st = self.state[component]
        out = {}
        for key, total in st.items():
            if key.startswith("param:"):
                name = key.removeprefix("param:")
                n = int(st[f"param_samples:{name}"])
                out[name] = (total / max(n, 1)).cpu()
        return out

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        out: dict[str, Any] = {}
        if "unit_sq" in s:
            count = s["unit_count"]
            out["unit"] = as_floats(rates(s["unit_sq"], count))
            elements = int(count.sum()) + int(s["nonfinite"])
            out["nonfinite_fraction"] = int(s["nonfinite"]) / elements if elements else 0.0
            out["samples"] = float(int(count.max()) if count.numel() else 0)
        flats = []
        for key, total in s.items():
            if not key.startswith("param:"):
                continue
            name = key.removeprefix("param:")
            n = int(s[f"param_samples:{name}"])
            fisher = total / n if n else torch.zeros_like(total)
            flats.append(fisher.reshape(-1))
            out[f"{name}.trace"] = float(fisher.sum())
        if flats:
            allf = torch.cat(flats)
            out["trace"] = float(allf.sum())
            out["mean"] = float(allf.mean())
            out["max"] = float(allf.max())
            out["dead_param_fraction"] = float((allf < cfg["dead_threshold"]).double().mean())
        out["unsupported_params"] = float(len(cfg.get("unsupported", ())))
        return out


class FisherInformationHook(ProbeHook):
    probe = "fisher"
    backward = True

    def __init__(self, tracker: FisherInformationState, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = tracker

    def record_grad(self, module: nn.Module, grad_output: torch.Tensor) -> None:
        self.tracker.update(self.component, grad_output, self.context.loss_scale)

    # --------------------------------------------------------------- parameters
    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        handles = []
        covered: set[int] = set()
        for sub_name, sub in module.named_modules():
            prefix = f"{sub_name}." if sub_name else ""
            if isinstance(sub, nn.Linear):
                kind = "linear"
            elif isinstance(sub, nn.LayerNorm) and len(sub.normalized_shape) == 1:
                kind = "layer_norm"
            else:
                continue
            names = (
                f"{prefix}weight" if getattr(sub, "weight", None) is not None else None,
                f"{prefix}bias" if getattr(sub, "bias", None) is not None else None,
            )
            handles.append(sub.register_forward_hook(self._layer_hook(kind, names)))
            covered.update(id(p) for p in sub.parameters(recurse=False))
        unsupported = [n for n, p in module.named_parameters() if id(p) not in covered]
        settings = self.tracker.settings[self.component]
        warned = "unsupported" in settings  # attach() runs again each time the probe re-arms
        settings["unsupported"] = unsupported
        if unsupported and not warned:
            log.warning(
                "fisher probe on %r: no exact per-sample rule for parameters %s (only nn.Linear "
                "and last-dimension nn.LayerNorm are covered); they are left out of the trace",
                self.component,
                unsupported,
            )
        return handles

    def _tap(self, output: Any, compute: Any) -> None:
        """Register ``compute(grad)`` on ``output`` if this forward pass will be backpropagated."""
        if not (
            self.enabled
            and self.context.phase in self.phases
            and isinstance(output, torch.Tensor)
            and output.requires_grad
            and torch.is_grad_enabled()
        ):
            return

        def record(grad: torch.Tensor) -> None:
            if not self.enabled:
                return
            try:
                compute(grad)
            except Exception as exc:
                self.fail(exc)

        on_grad(output, record)

    def _layer_hook(self, kind: str, names: tuple[str | None, str | None]) -> Any:
        def hook(mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            x = inputs[0]
            if kind == "layer_norm":
                if not (self.active() and torch.is_grad_enabled() and output.requires_grad):
                    return
                x = F.layer_norm(x.detach(), mod.normalized_shape, eps=mod.eps)

            def compute(grad: torch.Tensor) -> None:
                self.tracker.update_layer(
                    self.component, kind, names, x, grad, self.context.loss_scale
                )

            self._tap(output, compute)

        return hook


def attach_fisher_information_hooks(
    *,
    loss_reduction: Literal["mean", "sum"] = "mean",
    dead_threshold: float = DEAD_PARAM_THRESHOLD,
    phases: Iterable[str] | str = ("train",),
    extractor: Extractor | None = None,
) -> BackwardHookBuilder:
    """Backward-hook builder for :class:`FisherInformationState`.

    ``loss_reduction`` says how the loss reduces over samples: ``"mean"`` (default,
    per-sample gradient = rows x autograd gradient) or ``"sum"``.
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")

    def build(component_name: str, context: ComponentContext) -> FisherInformationHook | None:
        tracker = get_state(context, "fisher", FisherInformationState)
        if not tracker.register_component(
            component_name, loss_reduction=loss_reduction, dead_threshold=dead_threshold
        ):
            return None
        return FisherInformationHook(tracker, component_name, context, phases, extractor)

    build.probe = "fisher"  # type: ignore[attr-defined]
    return build


def _factor(push: tuple[int, Any]) -> float:
    """The per-sample factor of one push (its gradient block's scale; 1 if none)."""
    scales = push[1]
    return 1.0 if scales is None or scales[-1] is None else float(scales[-1])
