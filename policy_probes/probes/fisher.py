"""Diagonal empirical Fisher information of a component (backward probe).

The empirical Fisher of a parameter theta is the mean over samples of the squared
per-sample gradient, F = (1/N) sum_i (d l_i / d theta)^2. Training losses are means over
the minibatch, L = c * (1/n) sum_i l_i, where c is ``context.loss_scale`` (1 unless the
loop scales the loss, e.g. for gradient accumulation). Autograd delivers
g_i = dL/dy_i = (c/n) dl_i/dy_i, so the per-sample gradient is (n/c) g_i. With
``loss_reduction="sum"`` (L = c * sum_i l_i) it is g_i / c.

Per-parameter Fisher is computed exactly from cached layer inputs (never from per-sample
gradient tensors or ``param.grad``):

* ``nn.Linear`` (y = x W^T + b): F_W = f^2 sum_i (g_i^2)^T (x_i^2) / N, F_b = f^2 sum_i g_i^2 / N
* ``nn.Conv1d``/``nn.Conv2d``, ``nn.Embedding``, ``nn.LayerNorm`` (any shape) and
  ``nn.GroupNorm``: the closed-form rules of :mod:`policy_probes.probes.fisher_rules`

where f is the per-sample factor above. Every other parametrised module (recurrent
layers, attention, user layers) goes through the exact ``torch.func`` route of
:mod:`policy_probes.probes.fisher_generic` unless ``generic="off"``. Parameters neither
covers are listed (``uncovered/<name>`` = number of entries, ``unsupported_params``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.layers import HiddenLayer
from policy_probes.plugins import register
from policy_probes.probes.fisher_generic import (
    Call,
    Layout,
    OutputTap,
    batch_layout,
    clean,
    per_sample_squares,
    row_finite,
)
from policy_probes.probes.fisher_rules import Names, chunk_bytes_for, layer_kind
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT, Rows
from policy_probes.probes.state import ALIKE, Drained, as_rows, unit_rates
from policy_probes.probes.weighted import Weighted
from policy_probes.row_mask import loss_samples
from policy_probes.torch_internals import (
    queue_after_backward,
    tree_flatten_cached,
    tree_leaves,
    tree_unflatten,
)
from policy_probes.user_errors import ProbeError

if TYPE_CHECKING:
    from policy_probes.probes.fisher_rules import LayerKind, LayerRule
    from policy_probes.probes.observation import Observation

log = logging.getLogger("policy_probes")

DEAD_PARAM_THRESHOLD = 1e-8


@register
class FisherInformation(Probe):
    """Sums of squared per-sample gradients: per output unit and per parameter entry."""

    name = "fisher"
    maker = "attach_fisher_information_hooks()"
    direction = "backward"
    events = ("backward",)
    docs = "docs/probes/fisher.md"
    metrics = {
        "trace": "sum of the diagonal Fisher over the component's covered parameters",
        "unit": "per output unit: mean squared per-sample gradient",
        "grad_noise_scale": "B_simple = tr(Sigma) / |G|^2 (McCandlish et al., 2018)",
    }
    console = ("trace",)

    def __init__(
        self,
        *,
        loss_reduction: Literal["mean", "sum"] = "mean",
        dead_threshold: float = DEAD_PARAM_THRESHOLD,
        param_every: int = 1,
        generic: Literal["auto", "off"] = "auto",
        chunk_bytes: int | None = None,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not (isinstance(param_every, int) and param_every >= 1):
            raise ValueError(f"param_every must be an integer >= 1, got {param_every!r}")
        if generic not in ("auto", "off"):
            raise ValueError(f"generic must be 'auto' or 'off', got {generic!r}")
        if chunk_bytes is not None and not (isinstance(chunk_bytes, int) and chunk_bytes >= 1):
            raise ValueError(f"chunk_bytes must be an integer >= 1 (bytes), got {chunk_bytes!r}")
        super().__init__(
            loss_reduction=loss_reduction,
            dead_threshold=dead_threshold,
            param_every=param_every,
            generic=generic,
            chunk_bytes=chunk_bytes,
        )
        #: (component, stream) -> the closed-form rule reducing that stream's rows
        self.rules_of: dict[tuple[str, str], LayerRule] = {}
        #: component -> rows of its output gradient in the latest backward
        self.out_rows: dict[str, int] = {}
        #: component -> the installers of every hook :meth:`attach` installs (found once)
        self.plans: dict[str, list[Callable[[], list[RemovableHandle]]]] = {}
        #: component -> generic units whose inputs could not be split into samples
        self.given_up: dict[str, set[nn.Module]] = {}

    def unregister_component(self, name: str) -> None:
        super().unregister_component(name)
        self.rules_of = {k: v for k, v in self.rules_of.items() if k[0] != name}
        self.out_rows.pop(name, None)

    def sample_factor(
        self,
        component: str,
        rows: int,
        loss_scale: float | torch.Tensor,
        like: torch.Tensor | None = None,
    ) -> float | torch.Tensor:
        """Factor turning the autograd gradient of one row into its per-sample gradient.
        A mean loss averages over :func:`~policy_probes.row_mask.loss_samples` samples
        (``context.loss_samples``, else the row mask's kept rows, else ``rows``).
        ``loss_scale`` may be a 0-dim device tensor (an AMP scale): never read back."""
        if isinstance(loss_scale, torch.Tensor):
            scale: float | torch.Tensor = loss_scale.detach()
        else:
            scale = loss_scale if loss_scale else 1.0
        if self.settings[component]["loss_reduction"] == "sum":
            return 1.0 / scale
        if self.context is not None and like is not None:
            n = loss_samples(self.context, rows, like)
            if not isinstance(scale, torch.Tensor) and scale == 1:
                return n  # a mask's count: no kernel per push
            return n / scale
        return rows / scale

    def update(
        self,
        component: str,
        grad_output: torch.Tensor,
        loss_scale: float | torch.Tensor = 1.0,
        *,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Per-unit Fisher of the component output from one backward pass; ``weight``
        (every ``update_*``): the row-mask rows of the gradient."""
        g = as_rows(grad_output)
        self.out_rows[component] = g.shape[0]
        self._push_grad(component, "out", (), g, loss_scale, weight)

    def _push_grad(
        self,
        component: str,
        stream: str,
        held: tuple[torch.Tensor, ...],
        g: torch.Tensor,
        loss_scale: float | torch.Tensor,
        weight: torch.Tensor | None,
    ) -> None:
        """Hold the ``held`` blocks and the gradient rows ``g``, scaled by their per-sample
        factor (:meth:`sample_factor`)."""
        f = self.sample_factor(component, g.shape[0], loss_scale, g)
        self._push(component, stream, (*held, g), (*(None for _ in held), f), weight)

    def update_layer(
        self,
        component: str,
        kind: str,
        names: Names,
        x: torch.Tensor,
        grad_output: torch.Tensor,
        loss_scale: float | torch.Tensor = 1.0,
        *,
        weight: torch.Tensor | None = None,
    ) -> None:
        """One backward pass through an ``nn.Linear`` (``names``: weight, bias or None)."""
        stream = f"{kind}:{names[0] or ''}:{names[1] or ''}"
        self._push_grad(component, stream, (as_rows(x),), as_rows(grad_output), loss_scale, weight)

    def update_generic(
        self,
        component: str,
        module: nn.Module,
        names: dict[str, str],
        calls: list[Call],
        loss_scale: float | torch.Tensor = 1.0,
    ) -> None:
        """The passes of one backward through a module on the generic route, reduced right
        away (:func:`~policy_probes.probes.fisher_generic.per_sample_squares`). Samples
        non-finite in any pass or masked in every pass get weight 0 and are not counted."""
        n = calls[0].layout.batch
        like = next((g for c in calls for g in c.grads if g is not None), None)
        # Several rows per sample (an LSTM's steps): the loss averages over the
        # component output's rows (B*T for a loss on every step, B after pooling), as a
        # Linear on those rows counts them. One row per sample: n.
        rows = n
        if any(c.rows is not None and c.rows > c.layout.batch for c in calls):
            fallback = sum(c.layout.batch if c.rows is None else c.rows for c in calls)
            rows = self.out_rows.get(component, fallback)
        f = self.sample_factor(component, rows, loss_scale, like)
        checks = []
        for c in calls:
            lay = c.layout
            checks += [
                (t, d) for t, d in zip(lay.leaves, lay.in_dims, strict=True) if d is not None
            ]
            checks += [(g, d) for g, d in zip(c.grads, lay.out_dims, strict=True) if g is not None]
        ok = row_finite(checks, n)
        masks = [c.weight.to(ok.dtype) for c in calls if c.weight is not None]
        if masks:
            ok = ok * functools.reduce(torch.maximum, masks)
        w = ok * f  # the per-row weight of this backward
        calls = [
            Call(
                dataclasses.replace(c.layout, leaves=[clean(t) for t in c.layout.leaves]),
                [clean(g) for g in c.grads],
                c.weight,
            )
            for c in calls
        ]
        samples = ok.sum().to(COUNT)
        chunk = chunk_bytes_for(self.settings[component]["chunk_bytes"], w.device)
        for local, value in per_sample_squares(module, calls, w, chunk).items():
            self._add(component, f"param:{names[local]}", value)
            self._add(component, f"param_samples:{names[local]}", samples, COUNT)

    def batches(self, stream: str) -> bool:
        """Only the output gradients' stream (per-unit accumulators) is reduced alike."""
        return stream == "out"

    def consume(self, batch: Drained) -> None:
        component, stream, cols = batch.component, batch.stream, batch.cols
        mask = batch.weight  # the row mask's rows (``weight`` names a parameter below)
        g = cols[-1]
        # w: every row's per-sample factor f (the gradient block's push scale)
        w = self.scratch(g.clean[:, 0], 1)
        lo = 0
        for _, run in itertools.groupby(
            zip(batch.segments, batch.scales, strict=True), key=_factor_key
        ):
            run = list(run)
            hi = lo + sum(n for n, _ in run)
            w[lo:hi].fill_(_factor(run[0]))
            lo = hi
        if mask is not None:  # masked rows: factor 0 (and not counted below)
            w.mul_(mask.to(w.dtype))
        if stream in ("out", ALIKE):
            # sum_i (f_i g_i)^2 per unit: one matrix-vector product with f^2
            unit_sq = torch.mv(g.square().T, w.square_())
            self._add(component, "unit_sq", unit_sq)
            kept = Weighted(g, mask)  # rows the row mask keeps (all without one)
            self._add(component, "unit_count", kept.finite_count(), COUNT)
            self._add(component, "nonfinite", kept.nonfinite_counts(), COUNT)
            return
        kind, weight, bias = stream.split(":")[:3]
        rule = self.rules_of.get((component, stream))
        x = cols[0]
        # a row with any non-finite input, gradient or activation output gets weight 0
        if mask is None and all(c.all_finite for c in cols):  # every row is a sample
            samples = torch.full((), x.num_rows, dtype=COUNT, device=w.device)
        else:
            bad = torch.add(x.row_nonfinite(), g.row_nonfinite())
            if len(cols) == 3:
                bad.add_(cols[1].row_nonfinite())
            ok = bad.sign_().neg_().add_(1.0)
            if mask is not None:  # masked rows are not samples
                ok.mul_(mask.to(ok.dtype))
            w.mul_(ok)
            samples = ok.sum().to(COUNT)
        gs = self.scratch(g.clean, 1)
        if kind.startswith("linear@"):  # the Linear's output gradient: g * act'(a)
            _activation_derivative(kind.removeprefix("linear@"), cols[1], out=gs)
            gs.mul_(g.clean).mul_(w[:, None])
            kind = "linear"
        else:
            torch.mul(g.clean, w[:, None], out=gs)  # f g, 0 where dropped
        if rule is not None:
            chunk = chunk_bytes_for(self.settings[component]["chunk_bytes"], gs.device)
            sq = rule.squares(x.clean, gs, chunk)
        else:  # nn.Linear
            # the summed per-sample gradient (gradient noise scale), before gs is squared
            self._add(component, f"param_gsum:{weight}", gs.T @ x.clean)
            if bias:
                self._add(component, f"param_gsum:{bias}", gs.sum(0))
            g2 = gs.square_()
            sq = {weight: g2.T @ x.square()}
            if bias:
                sq[bias] = g2.sum(0)
        for name, value in sq.items():
            self._add(component, f"param:{name}", value)
            self._add(component, f"param_samples:{name}", samples, COUNT)

    def record_grad(
        self,
        obs: Observation,
        module: nn.Module,
        grad: torch.Tensor,
        weight: Any,
        loss_scale: float | torch.Tensor,
    ) -> None:
        self.update(obs.component, grad, loss_scale, weight=weight)

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        """The parametrised layers inside the component (hooked for their inputs)."""
        params = [name for name, _ in module.named_parameters()]
        if not params:
            return ""
        return (
            f"the layers holding its parameters ({', '.join(params)}): the per-parameter "
            f"Fisher (trace, mean, max, dead_param_fraction) reads their inputs through "
            f"hooks of their own"
        )

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        if obs.component not in self.plans:
            self.plans[obs.component] = _FisherHooks(self, obs).plan(module)
        return [handle for install in self.plans[obs.component] for handle in install()]

    def param_fisher(self, component: str) -> dict[str, torch.Tensor]:
        """Per-entry diagonal Fisher of every covered parameter in the window, on the host."""
        self.flush()
        return {name: (t / max(n, 1)).cpu() for name, t, n in _params(self.state[component])}

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        # numpy on the host copies (see ReLUActivation.summarize_alike)
        a = {key: t.numpy() for key, t in s.items()}
        out: dict[str, Any] = {}
        if "unit_sq" in a:
            count = a["unit_count"]
            out["unit"] = unit_rates(a["unit_sq"], count).tolist()
            nonfinite = int(a["nonfinite"].sum())
            elements = int(count.sum()) + nonfinite
            out["nonfinite_fraction"] = nonfinite / elements if elements else 0.0
            out["samples"] = float(int(count.max()) if count.size else 0)
        # per parameter, not over one concatenated copy (a conv encoder's millions of entries)
        traces: dict[str, float] = {}
        entries = dead = 0
        peak = -math.inf
        for name, total, n in _params(a):
            fisher = total / n if n else np.zeros_like(total)
            traces[name] = out[f"{name}.trace"] = float(fisher.sum())
            if fisher.size:
                peak = float(np.maximum(peak, fisher.max()))  # NaN propagates, as in max
                dead += int(np.count_nonzero(fisher < cfg["dead_threshold"]))
                entries += fisher.size
        if traces:
            out["trace"] = float(sum(traces.values()))
            out["mean"] = out["trace"] / entries if entries else math.nan
            out["max"] = peak if entries else math.nan
            out["dead_param_fraction"] = dead / entries if entries else math.nan
        out.update(noise_scale(a, traces))
        uncovered = cfg.get("uncovered", {})
        out.update((f"uncovered/{name}", float(n)) for name, n in uncovered.items())
        out["unsupported_params"] = float(len(uncovered))
        return out


def noise_scale(s: dict[str, np.ndarray], traces: dict[str, float]) -> dict[str, float]:
    """Gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al., 2018, "An
    empirical model of large-batch training") over the parameters whose summed per-sample
    gradient the probe holds (``nn.Linear`` weights and biases).

    With N samples, S = (1/N) Σ_i |g_i|² (the Fisher trace of those parameters) and
    ḡ = (1/N) Σ_i g_i, the unbiased estimates (the paper's two-batch-size estimator with
    batch sizes 1 and N) are |G|² ≈ (N |ḡ|² − S) / (N − 1) and
    tr(Σ) ≈ N (S − |ḡ|²) / (N − 1), reported when N > 1 (the noise scale when |G|² > 0).
    ``traces``: every parameter's S (the Fisher's per-parameter trace)."""
    out: dict[str, float] = {}
    total_sq, total_gsq, n_min = 0.0, 0.0, None
    for name, gsum, n in _params(s, "param_gsum"):
        if n < 2:
            continue
        sq = traces[name]  # S
        gsq = float(((gsum / n) ** 2).sum())  # |ḡ|²
        total_sq += sq
        total_gsq += gsq
        n_min = n if n_min is None else min(n_min, n)
        out.update(_noise(f"{name}.", n, sq, gsq))
    if n_min is not None:
        out.update(_noise("", n_min, total_sq, total_gsq))
    return out


def _params(s: dict[str, Any], kind: str = "param") -> Iterator[tuple[str, Any, int]]:
    """``(name, accumulator, samples)`` of every ``<kind>:<name>`` accumulator in ``s``."""
    for key, total in s.items():
        if key.startswith(f"{kind}:"):
            name = key.removeprefix(f"{kind}:")
            yield name, total, int(s[f"param_samples:{name}"])


def _noise(prefix: str, n: int, sq: float, gsq: float) -> dict[str, float]:
    grad_sq = (n * gsq - sq) / (n - 1)
    var_trace = n * (sq - gsq) / (n - 1)
    out = {f"{prefix}grad_sq_norm": grad_sq, f"{prefix}grad_var_trace": var_trace}
    if grad_sq > 0:
        out[f"{prefix}grad_noise_scale"] = var_trace / grad_sq
    return out


@dataclasses.dataclass(slots=True, eq=False)
class _GenericDelivery:
    """Records a generic-route pass (:class:`Call`) when its tapped outputs' gradients
    arrive, under the fault rule (slotted: one per pass, alive until the backward; the
    outputs are not held)."""

    obs: Observation
    arrived: Callable[[Call, float | torch.Tensor], None]
    layout: Layout
    tapped: tuple[int, ...]
    width: int
    rows: int | None
    weight: torch.Tensor | None

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        obs = self.obs
        if not obs.enabled:
            return
        try:
            full: list[torch.Tensor | None] = [None] * self.width
            for i, g in zip(self.tapped, grads, strict=True):
                full[i] = g
            call = Call(self.layout, full, self.weight, self.rows)
            self.arrived(call, obs.context.loss_scale)
        except Exception as exc:  # a probe must never take training down
            obs.fail(exc)


class _FisherHooks:
    """The Fisher probe's hooks on the layers inside the component of ``obs``."""

    def __init__(self, probe: FisherInformation, obs: Observation) -> None:
        self.probe = probe
        self.obs = obs
        self.component = obs.component
        self.param_every: int = probe.settings[obs.component]["param_every"]
        self.given_up = probe.given_up.setdefault(obs.component, set())

    def plan(self, module: nn.Module) -> list[Callable[[], list[RemovableHandle]]]:
        """The installers of every hook :meth:`FisherInformation.attach` installs; the
        parameters left out are listed (``uncovered``) and warned about once."""
        plan: list[Callable[[], list[RemovableHandle]]] = []
        covered: set[int] = set()
        settings = self.probe.settings[self.component]
        inside: set[int] = set()  # the modules of generic units
        for sub_name, sub in module.named_modules():  # parents before their children
            if id(sub) in inside:
                continue
            prefix = f"{sub_name}." if sub_name else ""
            own = list(sub.parameters(recurse=False))
            kind = layer_kind(sub)  # nothing to learn without parameters (a norm without affine)
            # parameters of its own that no closed-form rule covers
            generic = settings["generic"] == "auto" and kind is None and own
            if generic and _generic_capable(sub):
                # the whole subtree goes through torch.func (a forward may use a child's
                # parameters without calling it: nn.MultiheadAttention's out_proj)
                names = {k: f"{prefix}{k}" for k, _ in sub.named_parameters()}
                sizes = {f"{prefix}{k}": p.numel() for k, p in sub.named_parameters()}
                plan.append(functools.partial(self._generic_hooks, sub, names, sizes))
                covered.update(id(p) for p in sub.parameters())
                inside.update(id(m) for m in sub.modules())
                continue
            activation = derivable_hidden_layer(sub)
            if activation is not None:
                names = _names(f"{prefix}linear.", sub.linear)
                make = self._through_activation_hook
                plan.append(functools.partial(self._forward_hook, sub, make, activation, names))
                covered.update(id(p) for p in sub.linear.parameters(recurse=False))
            for child, (linear, act, activation) in derivable_sequential_pairs(sub):
                if not any(id(p) in covered for p in linear.parameters(recurse=False)):
                    names = _names(f"{prefix}{child}.", linear)
                    pair = self._sequential_pair_hooks
                    plan.append(functools.partial(pair, linear, act, activation, names))
                    covered.update(id(p) for p in linear.parameters(recurse=False))
            if kind is not None and own and not any(id(p) in covered for p in own):
                make = self._layer_hook
                plan.append(
                    functools.partial(self._forward_hook, sub, make, kind, _names(prefix, sub))
                )
                covered.update(id(p) for p in own)
        uncovered = {n: p.numel() for n, p in module.named_parameters() if id(p) not in covered}
        settings["uncovered"] = uncovered
        settings["unsupported"] = list(uncovered)
        if uncovered:
            log.warning(
                "fisher probe on %r: parameters %s are left out of the Fisher (listed under "
                "uncovered/<name>); %s",
                self.component,
                list(uncovered),
                "generic='auto' covers them through torch.func"
                if settings["generic"] == "off"
                else "their modules have no forward of their own (nn.ParameterList) or a "
                "batch-dependent gradient (batch norm, scale_grad_by_freq)",
            )
        return plan

    def _forward_hook(
        self, module: nn.Module, make: Callable[..., Any], *args: Any
    ) -> list[RemovableHandle]:
        """Register ``make(*args)``, timed, as a forward hook of ``module``."""
        return [module.register_forward_hook(self.obs.timed(make(*args)))]

    def _generic_hooks(
        self, module: nn.Module, names: dict[str, str], sizes: dict[str, int]
    ) -> list[RemovableHandle]:
        """The generic route's forward hook on ``module``, unless it gave up on it."""
        if module in self.given_up:
            return []
        hook = self._generic_hook(module, names, sizes)
        return [module.register_forward_hook(self.obs.timed(hook), with_kwargs=True)]

    def _generic_hook(self, module: nn.Module, names: dict[str, str], sizes: dict[str, int]) -> Any:
        """Forward hook of a module on the generic route: its inputs split into samples
        (:func:`~policy_probes.probes.fisher_generic.batch_layout`), the passes of one
        backward reduced together when it ends (a cell stepped over time). A module whose
        inputs cannot be split is reported once, listed as uncovered and left alone."""
        obs, probe = self.obs, self.probe
        backwards = itertools.count()
        gave_up: list[bool] = [False]
        pending: list[Call] = []  # passes of the running backward, by arrival
        scale: list[float | torch.Tensor] = [1.0]  # the backward's, with its first pass

        def reduce_pending() -> None:
            calls = list(pending)
            pending.clear()
            # param_every counts backwards here: all passes of one backward belong together
            if not obs.enabled or next(backwards) % self.param_every:
                return
            try:
                by_batch: dict[int, list[Call]] = {}
                for call in calls:
                    by_batch.setdefault(call.layout.batch, []).append(call)
                for group in by_batch.values():
                    probe.update_generic(self.component, module, names, group, scale[0])
            except Exception as exc:
                obs.fail(exc)

        def arrived(call: Call, loss_scale: float | torch.Tensor) -> None:
            if not pending:  # first pass of this backward: reduce when it ends
                scale[0] = loss_scale
                queue_after_backward(reduce_pending)
            pending.append(call)

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if gave_up[0] or not self._recorded(output, None):
                return
            try:
                layout = batch_layout(mod, args, kwargs, output)
            except ProbeError as exc:
                gave_up[0] = True
                self._give_up(mod, sizes, exc)
                return
            layout.leaves = [
                t.detach() if isinstance(t, torch.Tensor) else t for t in layout.leaves
            ]
            outs, spec = tree_flatten_cached(output)
            rows = _output_rows(outs[0])
            mask = obs.context.row_mask
            try:  # the mask entries of its samples: kept when any of its rows is
                weight = None
                if mask is not None:
                    key = (id(obs), id(mod))
                    weight = mask.per_sample(outs[0], layout.batch, rows, mod, self.component, key)
            except Exception as exc:
                obs.fail(exc)
                return
            tapped = tuple(
                i for i, t in enumerate(outs) if isinstance(t, torch.Tensor) and t.requires_grad
            )
            # copies of the outputs from one autograd node: their gradients flow in from
            # outside only (an LSTM cell's c also reaches its h inside), and in-place ops
            # downstream leave them intact
            delivery = _GenericDelivery(obs, arrived, layout, tapped, len(outs), rows, weight)
            copies = OutputTap.apply(delivery, *(outs[i] for i in tapped))
            for i, t in zip(tapped, copies, strict=True):
                outs[i] = t
            return tree_unflatten(outs, spec)

        return hook

    def _give_up(self, module: nn.Module, sizes: dict[str, int], exc: ProbeError) -> None:
        """List a generic unit's parameters (name -> entries) as uncovered after ``exc``."""
        settings = self.probe.settings[self.component]
        settings["uncovered"].update(sizes)
        settings["unsupported"] = list(settings["uncovered"])
        self.given_up.add(module)
        log.warning(
            "fisher probe on %r: %s; parameters %s are left out (uncovered/<name>)",
            self.component,
            exc,
            list(sizes),
        )

    def _recorded(self, output: Any, passes: Iterator[int] | None) -> bool:
        """Whether this forward pass feeds the per-parameter Fisher: backpropagated in an
        active phase, one of every ``param_every`` (``passes`` counts; None: all)."""
        obs = self.obs
        if not (
            obs.enabled
            and obs.context.phase in obs.phases
            and torch.is_grad_enabled()
            and _carries_grad(output)
        ):
            return False
        return passes is None or next(passes) % self.param_every == 0

    def _tap(
        self,
        output: torch.Tensor,
        stream: str,
        held: tuple[torch.Tensor, ...],
        layer: Any,
        samples: tuple[int, int] | None = None,
    ) -> None:
        """On the gradient of ``output`` hold ``held`` (no autograd graph) and the gradient's
        rows as ``stream`` (:meth:`FisherInformation._push_grad`), the row-mask rows bound
        now; ``samples = (samples, rows)``: ``held`` has a row per sample, each holding
        ``rows`` mask rows (:meth:`RowMask.per_sample`), and so is the gradient read."""
        obs, probe, component = self.obs, self.probe, self.component
        n = None if samples is None else samples[0]
        key, mask = (id(obs), layer), obs.context.row_mask
        try:
            if mask is None:
                weight = None
            elif samples is None:
                weight = mask.weight_for(output, None, self.component, key)
            else:
                weight = mask.per_sample(output, *samples, None, self.component, key)
        except Exception as exc:
            obs.fail(exc)
            return

        def compute(grad: torch.Tensor, weight: Any, loss_scale: Any) -> None:
            g = as_rows(grad) if n is None else grad.detach().reshape(n, -1)
            probe._push_grad(component, stream, held, g, loss_scale, weight)

        obs.tap(output, weight, compute)

    def _through_activation_hook(self, activation: str, names: Names) -> Any:
        """Forward hook of a :class:`~policy_probes.layers.HiddenLayer`."""
        passes = itertools.count()

        def hook(mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if self._recorded(output, passes):
                self._tap_through_activation(activation, names, inputs[0], output)

        return hook

    def _tap_through_activation(
        self, activation: str, names: Names, x: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Read ``act(linear(x))`` (:data:`ACTIVATIONS`): the Linear's output gradient
        ``grad * act'(output)`` is formed at the drain, from tensors other probes read too
        (no autograd hook on the Linear's output)."""
        # detached: a hook held by the output must not hold it (a cycle never freed)
        stream = f"linear@{activation}:{names[0] or ''}:{names[1] or ''}"
        self._tap(output, stream, (as_rows(x), as_rows(output)), names)

    def _sequential_pair_hooks(
        self, linear: nn.Linear, act: nn.Module, activation: str, names: Names
    ) -> list[RemovableHandle]:
        """Forward hooks of an ``nn.Sequential``'s Linear and the activation right after
        it: when the activation received exactly the Linear's output, the pair is read
        like a :class:`~policy_probes.layers.HiddenLayer`."""
        seen: list[Any] = [None, None]  # the Linear's (input, output) of this pass
        passes = itertools.count()

        def linear_hook(mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            seen[0], seen[1] = inputs[0], output

        def act_hook(mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            x, z = seen
            seen[0] = seen[1] = None  # hold nothing past this pass
            if z is not None and inputs[0] is z and self._recorded(output, passes):
                self._tap_through_activation(activation, names, x, output)

        return [
            linear.register_forward_hook(self.obs.timed(linear_hook)),
            act.register_forward_hook(self.obs.timed(act_hook)),
        ]

    def _layer_hook(self, kind: LayerKind, names: Names) -> Any:
        """Forward hook of a layer read in closed form (``LAYER_KINDS``)."""
        passes = itertools.count()
        probe, component = self.probe, self.component

        def hook(mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not self._recorded(output, passes):
                return
            x = inputs[0].detach()
            stream = f"{kind.name}:{names[0] or ''}:{names[1] or ''}"
            if kind.rows is None:  # nn.Linear: its input rows as they are
                self._tap(output, stream, (as_rows(x),), names)
                return
            rule, rows, shape = kind.rows(mod, names, x, output.detach())
            stream = f"{stream}:{shape}"
            probe.rules_of[(component, stream)] = rule
            n = rows.shape[0]
            self._tap(output, stream, (rows,), names, (n, n * kind.positions(mod, rows, output)))

        return hook


def attach_fisher_information_hooks(
    *,
    loss_reduction: Literal["mean", "sum"] = "mean",
    dead_threshold: float = DEAD_PARAM_THRESHOLD,
    param_every: int = 1,
    generic: Literal["auto", "off"] = "auto",
    chunk_bytes: int | None = None,
) -> FisherInformation:
    """The ``fisher`` probe (:class:`FisherInformation`), placed with ``phases``,
    ``extractor`` and ``schedule``. ``loss_reduction``: ``"mean"`` (per-sample gradient =
    rows x autograd gradient) or ``"sum"``. ``param_every = k``: the per-parameter Fisher
    from every k-th backward pass of each layer (unbiased; the per-unit Fisher uses every
    pass), for wide layers, whose extra weight-gradient-sized matmul costs. ``generic``:
    ``"auto"`` covers modules without a closed-form rule exactly through ``torch.func``
    (several times a plain backward of them), ``"off"`` lists them under
    ``uncovered/<name>``. ``chunk_bytes`` bounds one chunk's temporaries in the conv,
    embedding, norm and generic rules (None: 8 MiB on the CPU, 64 MiB on accelerators)."""
    return FisherInformation(
        loss_reduction=loss_reduction,
        dead_threshold=dead_threshold,
        param_every=param_every,
        generic=generic,
        chunk_bytes=chunk_bytes,
    )


def _factor(push: tuple[int, Any]) -> float | torch.Tensor:
    """The per-sample factor of one push (its gradient block's scale; 1 if none)."""
    scales = push[1]
    if scales is None or scales[-1] is None:
        return 1.0
    f = scales[-1]
    return f if isinstance(f, torch.Tensor) else float(f)


def _factor_key(push: tuple[int, Any]) -> Any:
    """Groups pushes with the same factor without comparing tensors (no host sync)."""
    f = _factor(push)
    return ("tensor", id(f)) if isinstance(f, torch.Tensor) else f


def _output_rows(first: Any) -> int | None:
    """Rows of a generic unit's first output read as ``(rows, features)``, as a row mask
    and a mean loss count them (None: not a tensor)."""
    if not isinstance(first, torch.Tensor):
        return None
    return first.numel() // max(first.shape[-1], 1) if first.dim() > 1 else first.numel()


def _carries_grad(output: Any) -> bool:
    """Whether ``output`` (a tensor or a nest of them) has a tensor that requires grad."""
    if isinstance(output, torch.Tensor):
        return output.requires_grad
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output))


def _names(prefix: str, layer: nn.Module) -> Names:
    """The names of ``layer``'s (weight, bias) under ``prefix``; None for one it lacks."""
    return tuple(  # type: ignore[return-value]
        f"{prefix}{k}" if getattr(layer, k, None) is not None else None for k in ("weight", "bias")
    )


def _generic_capable(module: nn.Module) -> bool:
    """Whether the generic route can take ``module``: a forward of its own (not an
    ``nn.ParameterList``) and per-sample gradients (not batch norm or
    ``nn.Embedding(scale_grad_by_freq=True)``, whose gradients depend on the batch)."""
    if type(module).forward is nn.Module.forward:
        return False
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False
    return not (isinstance(module, nn.Embedding) and module.scale_grad_by_freq)


#: activations whose derivative follows exactly from their output (_tap_through_activation)
ACTIVATIONS: dict[type[nn.Module], str] = {
    nn.ReLU: "relu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Identity: "identity",
    nn.LeakyReLU: "leaky_relu",
}
#: act'(z) from the finite activation output ``a`` into ``out``, exactly as autograd forms it
DERIVATIVES: dict[str, Any] = {
    "relu": lambda a, out, slope: out.copy_(a.positive()),  # 1[a > 0]
    "tanh": lambda a, out, slope: torch.mul(a.square(), -1.0, out=out).add_(1.0),  # 1 - a^2
    "sigmoid": lambda a, out, slope: torch.sub(a.clean, a.square(), out=out),  # a - a^2
    "identity": lambda a, out, slope: out.fill_(1.0),
    # 1[a > 0] (1 - slope) + slope
    "leaky_relu": lambda a, out, slope: torch.mul(a.positive(), 1.0 - slope, out=out).add_(slope),
}


def derivable_hidden_layer(module: nn.Module) -> str | None:
    """:func:`derivable_activation` of ``module`` if it is a
    :class:`~policy_probes.layers.HiddenLayer` computing ``act(linear(x))``, else None."""
    if type(module).forward is not HiddenLayer.forward or type(module.linear) is not nn.Linear:
        return None
    return derivable_activation(module.act) if module.norm is None else None


def derivable_activation(act: nn.Module) -> str | None:
    """The name under which :data:`DERIVATIVES` knows ``act`` (``leaky_relu=<slope>``
    for LeakyReLU), or None (another type, in place, or a negative slope)."""
    name = ACTIVATIONS.get(type(act))
    if name is None or getattr(act, "inplace", False):
        return None
    if name == "leaky_relu":
        return f"leaky_relu={act.negative_slope!r}" if act.negative_slope >= 0 else None
    return name


def derivable_sequential_pairs(
    module: nn.Module,
) -> list[tuple[str, tuple[nn.Linear, nn.Module, str]]]:
    """``(child name, (linear, activation module, activation name))`` for every
    ``nn.Linear`` child of a plain ``nn.Sequential`` followed by a derivable activation."""
    if type(module).forward is not nn.Sequential.forward:
        return []
    children = list(module.named_children())
    out = []
    for (name, first), (_, second) in zip(children, children[1:], strict=False):
        activation = derivable_activation(second)
        if type(first) is nn.Linear and activation is not None:
            out.append((name, (first, second, activation)))
    return out


def _activation_derivative(activation: str, a: Rows, out: torch.Tensor) -> torch.Tensor:
    """act'(z) of the activation named ``activation`` (:func:`derivable_activation`)."""
    name, _, slope = activation.partition("=")
    return DERIVATIVES[name](a, out, float(slope or 0.0))
