"""HookManager: dispatches lifecycle hooks at the loop's hook points (the protocol:
``docs/lifecycle.md``). A hook that raises is logged (traceback the first time), reported
as ``hook_name/error = 1.0``, and training goes on."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from policy_probes.context import ComponentContext
from policy_probes.lifecycle.hook import TrainingHook
from policy_probes.lifecycle.model_context import ModelDataContext, device_of
from policy_probes.lifecycle.points import STEP_POINTS, EpochWindow, HookPoint
from policy_probes.lifecycle.rng import RNGState, capture_rng_state, restore_rng_state
from policy_probes.lifecycle.run_context import RunDataContext
from policy_probes.processes import current_rank as current_rank  # re-exported
from policy_probes.records import flatten_metrics

log = logging.getLogger("policy_probes.lifecycle")

ModelContextSource = ModelDataContext | Callable[[], ModelDataContext] | None
_CONTEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(RunDataContext))
_MANAGED_FIELDS = frozenset(
    {"point", "epoch", "step", "loop", "grads", "prev_step_grads", "last_metrics"}
)
HOOK_PHASE = "hook"


@dataclass(frozen=True)
class StepRecord:
    """The metrics of one step-point firing."""

    point: HookPoint
    epoch: int
    step: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class StepFlush:
    """What :meth:`HookManager.flush` returns: epoch means (also per point) and every firing."""

    summary: dict[str, Any] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)
    by_point: dict[HookPoint, dict[str, Any]] = field(default_factory=dict)


class HookManager:
    """Runs the selected ``hooks`` (:func:`~policy_probes.lifecycle.registry.select_hooks`)
    in a loop of type ``loop`` (``"ppo"``: the built-in trainer, ``"external"``:
    ProbeSession). ``model``, ``optimizer``, ``scheduler``, ``config`` and
    ``component_context`` are bound here (or with :meth:`bind`) and handed to every
    :class:`RunDataContext`. ``offload_state``: the hooks' state tensors wait on the CPU
    between firings; ``strict``: hook exceptions are re-raised; ``rank`` (default: the
    ``torch.distributed`` rank, else 0): off rank 0 only ``run_on_all_ranks`` hooks are kept."""

    def __init__(
        self,
        hooks: Iterable[TrainingHook] = (),
        *,
        loop: str,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        config: Any = None,
        component_context: ComponentContext | None = None,
        offload_state: bool = False,
        strict: bool = False,
        rank: int | None = None,
    ) -> None:
        self.rank = current_rank() if rank is None else rank
        self.hooks = [h for h in hooks if self.rank == 0 or h.run_on_all_ranks]
        names = [h.name for h in self.hooks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"hooks selected twice: {dupes}")
        self.loop, self.offload_state, self.strict = loop, offload_state, strict
        self._bound: dict[str, Any] = {}
        self.bind(model=model, optimizer=optimizer, scheduler=scheduler, config=config)
        self.bind(component_context=component_context)
        self._by_point: dict[HookPoint, list[tuple[TrainingHook, EpochWindow]]] = {}
        for hook in self.hooks:
            for point, window in hook.points(loop).items():
                self._by_point.setdefault(point, []).append((hook, window))
        self.needs_grads = any(h.needs_grads for h in self.hooks)
        self.needs_prev_step_grads = any(h.needs_prev_step_grads for h in self.hooks)
        self.needs_pre_epoch_state = any(h.needs_pre_epoch_state for h in self.hooks)
        self.last_metrics: dict[HookPoint, dict[str, Any]] = {}
        self.errors: dict[str, int] = {}
        self.error_messages: dict[str, str] = {}
        self._records: list[StepRecord] = []
        self._reset_grads(None)  # _grad_sum, _grad_steps, _grad_epoch
        self._prev_grads: dict[str, torch.Tensor] | None = None
        self._warned_pre_epoch = False
        if offload_state:
            for h in self.hooks:
                h.move_state("cpu")

    def bind(self, **objects: Any) -> HookManager:
        """Bind model, optimizer, scheduler, config or component_context (``None``: kept)."""
        allowed = {"model", "optimizer", "scheduler", "config", "component_context"}
        unknown = set(objects) - allowed
        if unknown:
            raise TypeError(f"bind() got {sorted(unknown)}; it accepts {sorted(allowed)}")
        self._bound.update({k: v for k, v in objects.items() if v is not None})
        return self

    @property
    def active(self) -> bool:
        """True when at least one hook is selected."""
        return bool(self.hooks)

    def hooks_at(self, point: HookPoint) -> list[TrainingHook]:
        return [h for h, _ in self._by_point.get(HookPoint.parse(point), ())]

    def fire(
        self,
        point: HookPoint | str,
        *,
        epoch: int,
        step: int | None = None,
        model_ctx: ModelContextSource = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Run the hooks due at ``point``; return their namespaced metrics (host values).

        At PRE_STEP/POST_STEP (``step``, the global optimizer step, required) the metrics
        are buffered for :meth:`flush` and ``{}`` is returned. ``model_ctx`` (a
        :class:`ModelDataContext` or a zero-argument factory) is used only when an
        intervention is due or a hook needs the pre-epoch state. Other keyword arguments
        are :class:`RunDataContext` fields (``batch``, ``loss``, ``stats``, ...)."""
        if not self.hooks:
            return {}
        point = point if isinstance(point, HookPoint) else HookPoint.parse(point)
        is_step = point in STEP_POINTS
        if is_step and step is None:
            raise ValueError(f"fire({point.name}) needs step=<global optimizer step>")
        bad = set(fields) - _CONTEXT_FIELDS | (set(fields) & _MANAGED_FIELDS)
        if bad:
            raise TypeError(
                f"fire() got unexpected field(s) {sorted(bad)}; RunDataContext fields it "
                f"accepts: {sorted(_CONTEXT_FIELDS - _MANAGED_FIELDS)}"
            )
        ctx_fields = {**self._bound, **fields}
        cache: list[ModelDataContext] = []
        if point is HookPoint.PRE_EPOCH and self.needs_grads:
            self._reset_grads(epoch)
        if point is HookPoint.PRE_EPOCH and self.needs_pre_epoch_state:
            mctx = self._model_ctx(model_ctx, cache)
            if mctx is not None:
                mctx.capture_pre_epoch()
            elif not self._warned_pre_epoch:
                self._warned_pre_epoch = True
                log.warning("a hook needs the pre-epoch state but fire(PRE_EPOCH) got no model_ctx")
        current_grads = None
        if point is HookPoint.PRE_STEP and (self.needs_grads or self.needs_prev_step_grads):
            current_grads = self._live_grads(ctx_fields.get("model"))
        due = [h for h, win in self._by_point.get(point, ()) if h.is_due(point, epoch, step, win)]
        metrics: dict[str, Any] = {}
        if due:
            metrics = self._dispatch(
                point, epoch, step, due, ctx_fields, current_grads, model_ctx, cache
            )
        if current_grads is not None:
            self._after_step(epoch, current_grads)
        if is_step:
            if metrics:
                self._records.append(StepRecord(point, epoch, int(step), metrics))
            return {}
        return _to_host(metrics)

    def _dispatch(
        self,
        point: HookPoint,
        epoch: int,
        step: int | None,
        due: list[TrainingHook],
        ctx_fields: dict[str, Any],
        current_grads: dict[str, torch.Tensor] | None,
        model_ctx: ModelContextSource,
        cache: list[ModelDataContext],
    ) -> dict[str, Any]:
        current: dict[str, Any] = {}
        self.last_metrics[point] = current
        run_ctx = RunDataContext(
            point=point,
            epoch=epoch,
            step=step,
            loop=self.loop,
            grads=self._grads_for(point, current_grads),
            prev_step_grads=None
            if self._prev_grads is None
            else MappingProxyType(self._prev_grads),
            last_metrics=MappingProxyType(self.last_metrics),
            **ctx_fields,
        )
        cc: ComponentContext | None = ctx_fields.get("component_context")
        if cc is not None and not any(h.runs_model for h in due):
            cc = None  # nothing runs the model: the probes' phase (and hooks) stay as they are
        previous_phase = cc.phase if cc is not None else None
        if cc is not None:
            cc.phase = HOOK_PHASE
        rng = capture_rng_state()
        device = device_of(ctx_fields.get("model"))
        completed = False
        try:
            observers = [h for h in due if not h.intervenes_at(point)]
            interventions = [h for h in due if h.intervenes_at(point)]
            for hook in observers:
                self._run(hook, point, current, rng, device, partial(_observe, hook, run_ctx))
            mctx = self._model_ctx(model_ctx, cache) if interventions else None
            if interventions and mctx is None:
                err = RuntimeError(
                    f"intervention due at {point.name} but fire() got no model_ctx; pass "
                    f"model_ctx=<ModelDataContext or factory>"
                )
                for hook in interventions:
                    self._fail(hook, point, err, current)
            elif interventions:
                token = mctx.save_checkpoint(full=True)  # the guardian
                try:
                    for hook in interventions:
                        try:
                            call = partial(hook.intervene, run_ctx, mctx)
                            self._run(hook, point, current, rng, device, call)
                        finally:
                            mctx.restore_checkpoint(token)
                finally:
                    mctx.discard_checkpoint(token)
            completed = True  # _run put the RNGs back after each hook: no second restore
        finally:
            if not completed:
                restore_rng_state(rng)
            if cc is not None:
                cc.phase = previous_phase
        return current

    def _run(
        self,
        hook: TrainingHook,
        point: HookPoint,
        current: dict[str, Any],
        rng: RNGState,
        device: torch.device,
        call: Callable[[], Any],
    ) -> None:
        try:
            if self.offload_state:
                hook.move_state(device)
            out = call()
            if not isinstance(out, Mapping | None):
                raise TypeError(
                    f"returned {type(out).__name__}; a hook must return a dict of metrics"
                )
            prefix = f"{hook.name}/" if hook.namespaced else ""
            for key, value in flatten_metrics(out or {}).items():
                current[prefix + key] = value
        except Exception as exc:
            self._fail(hook, point, exc, current)
        finally:
            if self.offload_state:
                hook.move_state("cpu")
            restore_rng_state(rng)

    def _fail(
        self, hook: TrainingHook, point: HookPoint, exc: Exception, current: dict[str, Any]
    ) -> None:
        if self.strict:
            raise exc
        count = self.errors.get(hook.name, 0) + 1
        self.errors[hook.name] = count
        message = self.error_messages[hook.name] = f"{type(exc).__name__}: {exc}"
        current[f"{hook.name}/error"] = 1.0
        if count == 1:
            log.error("hook %r raised at %s; training goes on", hook.name, point.name, exc_info=exc)
        elif count & (count - 1) == 0:  # 2, 4, 8, ... to keep the log readable
            log.warning("hook %r has raised %d times (last: %s)", hook.name, count, message)

    def flush(self) -> StepFlush:
        """The buffered step-point metrics on the host, with their means; call once per epoch."""
        records, self._records = self._records, []
        if not records:
            return StepFlush()
        host = _records_to_host(records)
        by_point = {
            point: _summarise([r for r in host if r.point is point])
            for point in dict.fromkeys(r.point for r in host)
        }
        return StepFlush(summary=_summarise(host), records=host, by_point=by_point)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to fire on as this one would: every non-empty hook
        ``state``, the gradients carried across steps, the last metrics per point and the
        step-point metrics not yet flushed (selection and settings are configuration)."""
        return {
            "hooks": {h.name: h.state for h in self.hooks if h.state},
            "grad_sum": self._grad_sum,
            "grad_steps": self._grad_steps,
            "grad_epoch": self._grad_epoch,
            "prev_grads": self._prev_grads,
            "last_metrics": {p.value: dict(m) for p, m in self.last_metrics.items()},
            "records": [
                {"point": r.point.value, "epoch": r.epoch, "step": r.step, "metrics": r.metrics}
                for r in self._records
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (tensors to the model's device; unmatched hooks kept)."""
        device = device_of(self._bound.get("model"))
        hook_device = torch.device("cpu") if self.offload_state else device
        saved_hooks = state.get("hooks") or {}
        for hook in self.hooks:
            if hook.name in saved_hooks:
                hook.state = saved_hooks[hook.name]
                hook.move_state(hook_device)

        def moved(grads: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
            return None if grads is None else {n: g.to(device) for n, g in grads.items()}

        self._grad_sum = moved(state.get("grad_sum"))
        self._grad_steps = int(state.get("grad_steps", 0))
        epoch = state.get("grad_epoch")
        self._grad_epoch = None if epoch is None else int(epoch)
        self._prev_grads = moved(state.get("prev_grads"))
        self.last_metrics = {
            HookPoint(p): dict(m) for p, m in (state.get("last_metrics") or {}).items()
        }
        self._records = [
            StepRecord(HookPoint(r["point"]), int(r["epoch"]), int(r["step"]), dict(r["metrics"]))
            for r in state.get("records") or ()
        ]

    def _model_ctx(
        self, source: ModelContextSource, cache: list[ModelDataContext]
    ) -> ModelDataContext | None:
        if not cache and source is not None:
            cache.append(source if isinstance(source, ModelDataContext) else source())
        return cache[0] if cache else None

    @staticmethod
    def _live_grads(model: nn.Module | None) -> dict[str, torch.Tensor]:
        params = () if model is None else model.named_parameters()
        return {n: p.grad for n, p in params if p.grad is not None}

    def _grads_for(
        self, point: HookPoint, current: dict[str, torch.Tensor] | None
    ) -> Mapping[str, torch.Tensor] | None:
        if not self.needs_grads:
            return None
        if point is HookPoint.PRE_STEP:
            return MappingProxyType(current or {})
        if self._grad_sum is None or not self._grad_steps:
            return None
        return MappingProxyType({n: g / self._grad_steps for n, g in self._grad_sum.items()})

    def _reset_grads(self, epoch: int | None) -> None:
        self._grad_sum: dict[str, torch.Tensor] | None = None
        self._grad_steps, self._grad_epoch = 0, epoch

    @torch.no_grad()
    def _after_step(self, epoch: int, grads: dict[str, torch.Tensor]) -> None:
        if self.needs_grads:
            if self._grad_epoch != epoch:
                self._reset_grads(epoch)
            if self._grad_sum is None:
                self._grad_sum = {}
            for n, g in grads.items():
                if n in self._grad_sum:
                    self._grad_sum[n].add_(g)
                else:
                    self._grad_sum[n] = g.detach().clone()
            self._grad_steps += 1
        if self.needs_prev_step_grads:
            self._prev_grads = {n: g.detach().clone() for n, g in grads.items()}


def _observe(hook: TrainingHook, run_ctx: RunDataContext) -> Any:
    with torch.no_grad():
        return hook.compute(run_ctx)


def _host_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return float(v) if v.dim() == 0 else [float(x) for x in v.reshape(-1).tolist()]
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # numpy scalars
        return v.item()
    return v


def _to_host(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: _host_value(v) for k, v in metrics.items()}


def _records_to_host(records: list[StepRecord]) -> list[StepRecord]:
    # One concatenation and one transfer per device for all buffered tensors.
    by_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for i, r in enumerate(records):
        for k, v in r.metrics.items():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append((i, k, v.detach()))
    values: dict[tuple[int, str], Any] = {}
    for items in by_device.values():
        flat = torch.cat([t.reshape(-1).to(torch.float64) for _, _, t in items]).cpu().tolist()
        offset = 0
        for i, k, t in items:
            n = t.numel()
            chunk = flat[offset : offset + n]
            values[(i, k)] = chunk[0] if t.dim() == 0 else chunk
            offset += n
    return [
        StepRecord(
            r.point,
            r.epoch,
            r.step,
            {k: values.get((i, k), _host_value(v)) for k, v in r.metrics.items()},
        )
        for i, r in enumerate(records)
    ]


def _summarise(records: list[StepRecord]) -> dict[str, Any]:
    values: dict[str, list[Any]] = {}
    for r in records:
        for k, v in r.metrics.items():
            values.setdefault(k, []).append(v)
    return {k: mean for k, vs in values.items() if (mean := _mean(vs)) is not None}


def _mean(values: list[Any]) -> Any:
    nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(nums) == len(values):
        return math.fsum(nums) / len(nums)
    lists = [v for v in values if isinstance(v, list)]
    if len(lists) == len(values) and len({len(v) for v in lists}) == 1:
        return [math.fsum(col) / len(col) for col in zip(*lists, strict=True)]
    return values[-1]
