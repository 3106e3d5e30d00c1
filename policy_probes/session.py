"""ProbeSession: the probes, lifecycle observers and sinks of any training loop (the
built-in trainer, the SB3 ``ProbeCallback``, a loop of your own)::

    probing = ProbeSettings(sinks=SinksConfig(console=False))
    with ProbeSession(agent, run="runs/ppo", probing=probing, optimizer=opt) as session:
        session.add_training_hook("actor.*", attach_relu_activation_hooks())
        session.add_training_backward_hook("actor", attach_fisher_information_hooks())
        for update in range(num_updates):
            with session.phase("rollout"):
                ...                             # collect experience (not recorded)
            ...                                 # update epochs: probes record here
            session.log({"train/value_loss": v_loss})
            session.epoch_end(step=global_step) # one record per epoch to every sink

Records number epochs from 1; PRE_EPOCH fires at an epoch's first session call. Leaving
the ``with`` block removes every hook and closes the run. See ``docs/external.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from policy_probes.analysis.live import LiveAnalysis
from policy_probes.components import PolicyAutoBuilder, ProbeHandle, ProbeSpec, add_probe
from policy_probes.context import PHASES, ComponentContext
from policy_probes.lifecycle import (
    STEP_POINTS,
    HookManager,
    HookPoint,
    InterventionHook,
    LoopModelDataContext,
    ModelDataContext,
    preserved_rng,
    snapshot_due,
)
from policy_probes.plugins import from_spec
from policy_probes.probe_settings import ProbeSettings
from policy_probes.probes.probe import Probe, ProbeBuilder
from policy_probes.records import POST_EPOCH, RESERVED_KEYS, Record, plain_metrics
from policy_probes.reference_states import ReferenceStates
from policy_probes.remedies.base import Remedy, RemedyRunner
from policy_probes.remedies.trigger import Produced
from policy_probes.run import Run
from policy_probes.sampling import Sampler
from policy_probes.stats_reporter import StatsReporter

log = logging.getLogger("policy_probes")

#: the loop type lifecycle hooks see (``loop_points``) unless the loop names its own
LOOP = "external"


class ProbeSession:
    """Probes, lifecycle observers and metric sinks for a training loop.

    Args:
        model: the policy, any ``nn.Module`` (wrapped, not changed, unless it is a
            :class:`PolicyAutoBuilder`).
        run: a :class:`~policy_probes.run.Run` or a path (default ``runs/session-<time>``),
            opened now; ``config.json`` and the sinks are written when the first epoch starts.
        probing: the probe settings (:class:`~policy_probes.probe_settings.ProbeSettings`).
        components: names for parts of ``model`` (``{"actor_mlp": "actor.0"}``), passed to
            ``wrap``; ``None`` names every direct child after its attribute.
        example_inputs: positional arguments for one :meth:`PolicyAutoBuilder.trace_outputs`.
        forward: runs the policy on a batch of observation rows (the reference states,
            churn's held-out batch); default ``model`` itself. A model whose forward takes
            more than a tensor (RLlib's RLModule, a TensorDict module, a ``ModuleDict``)
            needs one, e.g. ``lambda obs: (actor(obs), critic(obs))``.
        config: your run configuration; stored in ``config.json`` and the W&B run's config.
        optimizer, scheduler, loss_fn, model_context: as :meth:`bind` takes them (a loop
            that builds them after the session calls :meth:`bind` itself).
        loop: the loop type the lifecycle hooks see (``loop_points``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        run: Run | str | Path | None = None,
        probing: ProbeSettings | None = None,
        components: Mapping[str, nn.Module | str] | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        forward: Callable[[torch.Tensor], Any] | None = None,
        config: Mapping[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        model_context: ModelDataContext | None = None,
        loop: str = LOOP,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ProbeSession needs a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self.probing = probing if probing is not None else ProbeSettings()
        self.run = run if isinstance(run, Run) else Run(run)
        self.loop = loop
        self.policy = _probeable(model, components, example_inputs)
        if forward is not None and not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        #: runs the policy on observation rows (reference states, held-out batches)
        self.forward: Callable[[torch.Tensor], Any] = (
            forward if forward is not None else self.policy
        )
        self.context = ComponentContext(strict=self.probing.strict)
        self.context.reference_states = ReferenceStates(module=self.policy)
        self.sampler = Sampler(
            self.context, schedule=self.probing.probe_schedule, budget=self.probing.probe_budget
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.model_context: ModelDataContext | None = None
        self.epoch = 0  # epochs ended; the records number the current one epoch + 1
        self.agent_step: int | None = None
        self.closed = self._rollout_seen = self._epoch_started = False
        self._watching = self._started = False
        self._handles: list[ProbeHandle] = []
        self._probes: list[ProbeSpec] = []
        self._logged: dict[str, Any] = {}
        self._sums: dict[str, tuple[Any, int]] = {}
        self._pending: dict[str, Any] = {}
        self._step = 0
        self._step_hooks: list[Any] = []  # on the optimizer (pass ends, PRE_EPOCH)
        #: remedies added before the loop bound its optimizer: (pattern, remedy, seed)
        self._unbound_remedies: list[tuple[str, Remedy, int | None]] = []
        self.remedies = RemedyRunner()  # fired at every epoch_end
        #: the records emitted so far, their findings and figures (for the sinks)
        self.analysis = LiveAnalysis(max_epochs=self.probing.wandb.heatmap_history)
        selected = self.probing.lifecycle_hooks()
        self.config = self.run.config = {
            "session": {
                "model": type(model).__name__,
                "components": list(self.policy.components),
                "hooks": [h.name for h in selected],
                "snapshot_every": self.probing.snapshot_every,
                "probe_budget": self.sampler.budget,
                "probe_schedule": str(self.sampler.default),
            },
            **self.run.config,
            **dict(config or {}),
        }
        self.hooks = HookManager(
            selected,
            loop=loop,
            model=model,
            config=self.config,
            component_context=self.context,
            strict=self.probing.strict,
        )
        try:
            self._open_run()
            for spec in self.probing.probes:  # the configuration's probes
                component, probe, placement = from_spec(spec, "probe")
                self._attach(component, probe, None, placement)
            if optimizer is not None or model_context is not None or loss_fn is not None:
                self.bind(
                    optimizer, scheduler=scheduler, loss_fn=loss_fn, model_context=model_context
                )
        except BaseException:
            self.close()
            raise

    def _open_run(self) -> None:
        run = self.run
        if not run.opened:
            run.open()
        if run.resume and (last := run.last_recorded_epoch()) is not None:
            self.epoch = last
        self.context.infer_phase = True  # until set_phase(): no-grad forwards are not training
        self.sinks = run.sinks  # the run's sinks (filled when the first epoch starts)
        self.sinks.draw_figures = self.analysis.figures
        self.sampler.on_choice = run.choice_recorder()  # the probe budget's choice

    def bind(
        self,
        optimizer: torch.optim.Optimizer | None,
        *,
        scheduler: Any = None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        model_context: ModelDataContext | None = None,
    ) -> ProbeSession:
        """The loop's training objects: ``optimizer`` (its steps end the probes' passes;
        remedies and interventions need it), its ``scheduler``, and ``loss_fn(model,
        minibatch) -> loss`` (the exact mean loss the loop trains with), which enables the
        interventions (given the epoch's data, :meth:`set_data`) and ``probe_batch``
        schedules; or ``model_context``, a ready :class:`ModelDataContext` (or a
        zero-argument factory) instead of ``loss_fn``. Returns self."""
        if loss_fn is not None and model_context is None:
            if optimizer is None:
                raise ValueError("loss_fn=... needs optimizer=... (interventions replay updates)")
            model_context = LoopModelDataContext(
                self.module, optimizer, loss_fn, scheduler=scheduler
            )
        self.optimizer, self.model_context = optimizer, model_context
        self.hooks.bind(optimizer=optimizer, scheduler=scheduler)
        m = self.hooks
        if optimizer is not None and (m.hooks_at(HookPoint.PRE_EPOCH) or m.needs_pre_epoch_state):
            # PRE_EPOCH before the epoch's first update, whatever the loop calls first
            # eager in a compiled update step (a graph break); decorated here, not at the
            # class: that would import dynamo with this module (policy_probes/grad_tap.py)
            before_step = torch.compiler.disable(self._before_step)
            self._step_hooks.append(optimizer.register_step_pre_hook(before_step))
        if callable(model_context) or hasattr(model_context, "rows"):
            self.sampler.probe_batch_source = model_context  # probe batches through its loss
        self._watch_passes()
        self._check_hooks()
        if optimizer is not None:  # the remedies added so far, then the configuration's
            for pattern, remedy, seed in self._unbound_remedies:
                self.add_remedy(pattern, remedy, seed=seed)
            self._unbound_remedies = []
            for spec in self.probing.remedies:
                component, remedy, _ = from_spec(spec, "remedy")
                self.add_remedy(component, remedy)
        return self

    def _watch_passes(self) -> None:
        """End a probe pass at every optimizer step, once there are probes."""
        if not self._watching and self.optimizer is not None and self._probes:
            self._step_hooks.append(self.sampler.watch_optimizer(self.optimizer))
            self._watching = True

    def _before_step(self, *_args: Any) -> None:
        if self.context.phase != "hook":  # lifecycle replays are not the loop's updates
            self.epoch_start()

    def _check_hooks(self) -> None:
        """Refuse a lifecycle hook the loop cannot serve."""
        for hook in self.hooks.hooks:
            if isinstance(hook, InterventionHook) and self.model_context is None:
                raise ValueError(
                    f"lifecycle hook {hook.name!r} is an intervention; a ProbeSession runs "
                    f"interventions only with optimizer=... and loss_fn=(model, minibatch) -> "
                    f"loss (or model_context=...), plus the epoch's data via "
                    f"session.set_data(...) or session.rollout_end(...). Deselect it or pass them."
                )
            if hook.name == "adam_dynamics" and self.optimizer is None:
                raise ValueError(
                    "lifecycle hook 'adam_dynamics' reads the optimizer: pass optimizer=..."
                )
            if HookPoint.SNAPSHOT in hook.points(self.loop) and self.probing.snapshot_every <= 0:
                raise ValueError(
                    f"lifecycle hook {hook.name!r} fires at SNAPSHOT; set snapshot_every=N "
                    f"(every N epochs) or deselect it"
                )

    def check_remedy_triggers(self, namespaces: Collection[str] | None = None) -> None:
        """Refuse a remedy whose ``when=`` key no record of this run can hold: a probe that
        is not attached, a component that probe does not observe, or, given the first
        segments of the loop's own keys (``namespaces``), a key under any other. Called
        before the first epoch (a refused start writes nothing); a loop that knows its
        keys calls it once its remedies are bound."""
        probes: dict[str, list[str] | None] = {}
        declared: dict[str, list[str]] = {}
        for name, tracker in self.context.model_metrics.items():
            probe = str(getattr(tracker, "probe", name))
            components = getattr(tracker, "components", None)
            probes[probe] = None if components is None else list(components)
            declared[probe] = list(getattr(type(tracker), "metrics", None) or ())
        hooks = self.hooks.hooks
        if namespaces is not None and all(h.namespaced for h in hooks):
            namespaces = {
                *namespaces,
                *RESERVED_KEYS,
                "probes",
                "remedies",
                *(h.name for h in hooks),
            }
        else:  # a hook that keeps its keys as returned may write under any namespace
            namespaces = None
        complete = all(isinstance(builder, Probe) for _, builder, _, _ in self._probes)
        produced = Produced(probes, declared, complete, namespaces)
        for bound in self.remedies.bound:
            when = bound.remedy.trigger.when if bound.remedy.trigger is not None else None
            problem = None if when is None else when.unproduced(produced)
            if problem is not None:
                raise ValueError(f"remedy {bound.key}: {problem}")

    @property
    def run_dir(self) -> Path:
        return self.run.dir

    @property
    def wants_steps(self) -> bool:
        """Whether a lifecycle hook fires at (or reads gradients of) the step points (else a
        loop may skip :meth:`pre_step` and :meth:`post_step`)."""
        m = self.hooks
        return bool(
            any(m.hooks_at(p) for p in STEP_POINTS) or m.needs_grads or m.needs_prev_step_grads
        )

    @property
    def wants_observations(self) -> bool:
        """Whether a probe or lifecycle hook reads the observations :meth:`rollout_end` takes."""
        return (
            bool(self.hooks.hooks_at(HookPoint.POST_ROLLOUT))
            or self.context.reference_states.wanted
            or any(hasattr(t, "rollout_end") for t in self.context.model_metrics.values())
        )

    def add_training_hook(
        self, pattern: str, builder: ProbeBuilder, **placement: Any
    ) -> ProbeSession:
        """Attach a probe (or a plain forward hook closure) to a component name or glob now
        (``placement``: see ``Placement``); returns self, an unknown name raises ``KeyError``."""
        return self._attach(pattern, builder, None, placement)

    def add_training_backward_hook(
        self, pattern: str, builder: ProbeBuilder, **placement: Any
    ) -> ProbeSession:
        """Attach a backward probe (or plain backward hook closure) now; returns self."""
        return self._attach(pattern, builder, True, placement)

    def _attach(
        self, pattern: str, builder: ProbeBuilder, backward: bool | None, placement: dict[str, Any]
    ) -> ProbeSession:
        if self.closed:
            raise RuntimeError("this ProbeSession is closed; start a new one to attach probes")
        add_probe(self._probes, pattern, builder, backward, placement)
        try:
            handles = self.policy.attach(
                pattern, builder, self.context, backward=backward, **placement
            )
        except BaseException:
            self._probes.pop()
            raise
        self._handles.extend(handles)
        self._watch_passes()
        return self

    def add_remedy(self, pattern: str, remedy: Remedy, *, seed: int | None = None) -> ProbeSession:
        """Attach a remedy (:mod:`policy_probes.remedies`) to a component name or glob, fired in
        :meth:`epoch_end` once the loop binds its optimizer; ``seed``: its generator's if none."""
        if self.closed:
            raise RuntimeError("this ProbeSession is closed; start a new one to add remedies")
        if self.optimizer is None:
            self._unbound_remedies.append((pattern, remedy, seed))
            return self
        seed = torch.initial_seed() if seed is None else seed
        self.remedies.attach(self.policy, pattern, remedy, self.context, self.optimizer, seed)
        return self

    def next_pass(self) -> None:
        """End a training pass (for a loop without an optimizer)."""
        self.sampler.next_pass()

    @property
    def component_names(self) -> list[str]:
        """Every name a probe can be attached to."""
        return self.policy.component_names()

    @property
    def current_phase(self) -> str:
        return self.context.phase

    def set_phase(self, name: str) -> None:
        """``"rollout"``, ``"train"`` or ``"eval"``: probes record only in their ``phases``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase must be a non-empty string such as {PHASES}, got {name!r}")
        if name not in PHASES:
            log.warning(
                "phase %r is not one of %s; probes record only in their phases", name, PHASES
            )
        self.epoch_start()
        self.context.infer_phase = False  # the loop says what it does from now on
        self.context.phase = name

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """:meth:`set_phase` inside the block, the previous phase restored after it."""
        previous = self.context.phase
        self.set_phase(name)
        try:
            yield
        finally:
            self.context.phase = previous

    @contextmanager
    def row_mask(
        self, mask: torch.Tensor | None, *, loss_samples: float | torch.Tensor | None = None
    ) -> Iterator[None]:
        """Leave the rows the loss masks out of every probe in the block: ``mask`` is ``(rows,)``
        or ``(batch, time)``, 1 where the loss uses a row (None: all); ``loss_samples``: as in
        :meth:`set_loss_samples` (default: the kept rows)."""
        previous = (self.context.row_mask, self.context.loss_samples)
        self.context.row_mask = mask  # a fresh RowMask: per-step counts start at 0
        if loss_samples is not None:
            self.context.loss_samples = loss_samples
        try:
            yield
        finally:
            self.context.row_mask, self.context.loss_samples = previous

    def set_loss_samples(self, n: float | torch.Tensor | None) -> None:
        """State how many samples the loss averages over (the Fisher probe's per-sample
        factor) until changed; ``None``: the row mask's kept rows, else each pass's rows."""
        if n is not None and not isinstance(n, torch.Tensor) and not n > 0:
            raise ValueError(f"loss_samples must be a positive number of samples, got {n!r}")
        self.context.loss_samples = n

    def scale_loss(self, loss: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
        """``scaler.scale(loss)`` (mixed precision) that also tells the probes the factor as
        a 0-dim device tensor (``context.loss_scale``); call it before each backward."""
        self.context.loss_scale = scaler.scale(torch.ones((), device=loss.device))
        return scaler.scale(loss)

    def log(self, metrics: Mapping[str, Any], *, reduce: Literal["last", "mean"] = "last") -> None:
        """Add the loop's scalars to the epoch's record: the last value logged under a key,
        or the epoch's mean (``reduce="mean"``); tensors are read at :meth:`epoch_end`."""
        if reduce not in ("last", "mean"):
            raise ValueError(f"reduce must be 'last' or 'mean', got {reduce!r}")
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
            if reduce == "last":
                self._logged[key] = value
                self._sums.pop(key, None)
            else:
                total, n = self._sums.get(key, (0.0, 0))
                self._sums[key] = (total + value, n + 1)
                self._logged.pop(key, None)

    def set_data(
        self,
        *,
        minibatches: Sequence[Any] | None = None,
        data: Any = None,
        minibatch_size: int | None = None,
    ) -> None:
        """Give the interventions this epoch's data (see LoopModelDataContext.set_data)."""
        self.epoch_start()
        if self.model_context is None:
            raise RuntimeError(
                "set_data() needs loss_fn=... and optimizer=... (or model_context=...)"
            )
        if not hasattr(self.model_context, "set_data"):
            raise TypeError(f"{type(self.model_context).__name__} has no set_data()")
        self.model_context.set_data(
            minibatches=minibatches, data=data, minibatch_size=minibatch_size
        )

    def fix_reference_states(self, observations: torch.Tensor) -> ProbeSession:
        """Use ``observations`` (rows the policy takes) as the run's reference states
        instead of rows of the first rollout (docs/reference_states.md); returns self."""
        self.context.reference_states.fix(observations, self.epoch)
        self.context.reference_states.forward = self.forward
        return self

    def rollout_end(
        self,
        *,
        observations: torch.Tensor | None = None,
        minibatches: Sequence[Any] | None = None,
        data: Any = None,
        minibatch_size: int | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """After the rollout: the probes that read it get ``observations`` (flat rows), then
        POST_ROLLOUT fires with ``fields``; the data arguments go to :meth:`set_data`."""
        self.epoch_start()
        self._rollout_seen = True
        reference = self.context.reference_states
        if reference.wanted:
            reference.offer(observations, self.forward, self.epoch)
        for tracker in list(self.context.model_metrics.values()):
            if hasattr(tracker, "rollout_end"):
                try:
                    tracker.rollout_end(observations, self.forward)
                except Exception as exc:  # a probe must never take training down
                    if self.context.strict:
                        raise
                    tracker.errors["rollout_end"] = f"{type(exc).__name__}: {exc}"
        if minibatches is not None or data is not None:
            self.set_data(minibatches=minibatches, data=data, minibatch_size=minibatch_size)
        return self._fire(HookPoint.POST_ROLLOUT, pending=True, observations=observations, **fields)

    @property
    def optimizer_step(self) -> int:
        """The loop's optimizer steps so far (the hooks' ``step``; :meth:`post_step`)."""
        return self._step

    @optimizer_step.setter
    def optimizer_step(self, value: int) -> None:
        self._step = int(value)

    def pre_step(
        self,
        *,
        batch: Any = None,
        loss: torch.Tensor | None = None,
        step: int | None = None,
        **fields: Any,
    ) -> None:
        """Fire PRE_STEP after ``loss.backward()``, before clipping and ``optimizer.step()``
        (``step``: default the session's count; ``fields``: more ``RunDataContext`` fields)."""
        if loss is not None:
            fields["loss"] = loss.detach()
        self._fire_step(HookPoint.PRE_STEP, batch, step, fields)

    def post_step(self, *, batch: Any = None, step: int | None = None, **fields: Any) -> None:
        """Fire POST_STEP right after ``optimizer.step()`` and count the step (as pre_step)."""
        self._fire_step(HookPoint.POST_STEP, batch, step, fields)
        self._step += 1

    def _fire_step(
        self, point: HookPoint, batch: Any, step: int | None, fields: dict[str, Any]
    ) -> None:
        self.epoch_start()
        if step is not None:
            self._step = int(step)
        self._fire(point, batch=batch, **fields)

    def _fire(self, point: HookPoint, *, pending: bool = False, **fields: Any) -> dict[str, Any]:
        """Fire ``point`` now; ``pending``: its metrics join this epoch's record."""
        out = self.hooks.fire(
            point, epoch=self.record_epoch, step=self._step, model_ctx=self.model_context, **fields
        )
        if pending:
            self._pending.update(out)
        return out

    def epoch_start(self, **fields: Any) -> dict[str, Any]:
        """Fire PRE_EPOCH once per epoch (every session call does; a loop calls it to pass
        ``RunDataContext`` ``fields``). The first writes ``config.json``, opens the sinks."""
        if not self._started:  # the loop starts training: a refused start writes nothing
            if self.closed:
                raise RuntimeError("this ProbeSession is closed")
            if self._unbound_remedies or (self.probing.remedies and self.optimizer is None):
                raise ValueError(
                    "remedies change the policy's weights and reset the optimizer's state "
                    "for them; a ProbeSession without optimizer=... (evaluation only) cannot "
                    "run them. Pass the loop's optimizer to ProbeSession"
                )
            self._check_hooks()
            self.check_remedy_triggers()
            if self.probing.sinks.enabled("wandb"):  # every rank: all of them stop
                self.probing.wandb.check_credentials()  # wandb.mode=online without a key
            self.run.write_config()
            self.run.open_sinks(self.probing.sinks, self.probing.wandb)
            self.analysis.with_figures = any(s.logs_figures for s in self.sinks)
            if self.run.resume and self.run.main:  # the records before the resume
                self.analysis.load(self.run_dir)
            self._started = True
        if self._epoch_started:
            return {}
        self._epoch_started = True
        fields.setdefault("agent_step", self.agent_step)
        return self._fire(HookPoint.PRE_EPOCH, pending=True, **fields)

    @property
    def record_epoch(self) -> int:
        """The current epoch as records (and lifecycle hooks) number it, from 1."""
        return self.epoch + 1

    def epoch_end(self, step: int, **extra: Any) -> dict[str, Any]:
        """Close the epoch, emit its records (per step point, ``POST_EPOCH``, ``SNAPSHOT`` when
        due) and return its metrics; ``step``: the agent step; ``extra``: more metrics."""
        if self.closed:
            raise RuntimeError("this ProbeSession is closed")
        self.epoch_start()
        self.agent_step = int(step)
        logged = dict(self._logged)  # and the means of what was logged with reduce="mean"
        logged.update((key, total / n) for key, (total, n) in self._sums.items())
        self._logged, self._sums = {}, {}
        logged.update(extra)
        sampler = self.sampler
        start, collected = time.perf_counter(), sampler.collect_seconds
        metrics = dict(logged)
        metrics.update(StatsReporter(self.context).collect())  # every rank: a collective
        snapshot: dict[str, Any] | None = None
        records: list[tuple[str, dict[str, Any]]] = []  # the step points' means first
        if self.hooks.active:
            rollout_hooks = [h.name for h in self.hooks.hooks_at(HookPoint.POST_ROLLOUT)]
            if rollout_hooks and not self._rollout_seen:
                log.warning(
                    "lifecycle hooks %s fire at POST_ROLLOUT: call session.rollout_end("
                    "observations=...) after each rollout",
                    rollout_hooks,
                )
                self._rollout_seen = True  # warn once
            metrics.update(self._pending)
            lr = logged.get("train/learning_rate")  # (the scheduler may have stepped)
            if lr is None and self.optimizer is not None and self.optimizer.param_groups:
                lr = self.optimizer.param_groups[0]["lr"]
            lr = None if lr is None else float(lr)
            fields = {"agent_step": self.agent_step, "stats": logged, "learning_rate": lr}
            metrics.update(self._fire(HookPoint.POST_EPOCH, **fields))
            if snapshot_due(self.epoch, self.probing.snapshot_every):
                snapshot = self._fire(HookPoint.SNAPSHOT, agent_step=self.agent_step)
                metrics.update(snapshot)
            flushed = self.hooks.flush()
            metrics.update(flushed.summary)
            records = [(pt.value, plain_metrics(vals)) for pt, vals in flushed.by_point.items()]
        elif snapshot_due(self.epoch, self.probing.snapshot_every):
            snapshot = {}
        # plain once, for every sink and the analysis (flat keys, Python values)
        metrics = plain_metrics(metrics)
        snapshot = None if snapshot is None else plain_metrics(snapshot)
        if self.remedies:  # after the epoch's metrics (ReDo reads its scores), before records
            metrics.update(plain_metrics(self.remedies.end_epoch(self.epoch + 1, metrics)))
        records.append((POST_EPOCH, metrics))
        if snapshot is not None:
            records.append(("SNAPSHOT", snapshot))
        for point, values in records:  # through the live analysis (the run's findings)
            record = Record(self.record_epoch, point, self.agent_step, values)
            self.sinks.emit(self.analysis.add(record))
        if not self.hooks.active:
            # no lifecycle hook: the epoch end beyond the collection is the probes' cost
            collected = sampler.collect_seconds - collected
            sampler.charge(time.perf_counter() - start - collected)
        self._pending = {}
        self.epoch += 1
        self._epoch_started = False
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The session's state for a checkpoint (a resumed loop attaches its probes, then
        loads it); the sinks are flushed first, so a resume finds every record."""
        self.sinks.flush()
        return {
            "epoch": self.epoch,
            "optimizer_step": self._step,
            "agent_step": self.agent_step,
            "epoch_started": self._epoch_started,
            "pending": dict(self._pending),
            "logged": dict(self._logged),
            "sums": {k: [total, n] for k, (total, n) in self._sums.items()},
            "hooks": self.hooks.state_dict(),
            "sampler": self.sampler.state_dict(),  # a resumed run observes the same passes
            "remedies": self.remedies.state_dict(),  # generators and firing records
            "reference_states": self.context.reference_states.state_dict(),
            "trackers": {
                name: tracker.state_dict()
                for name, tracker in self.context.model_metrics.items()
                if hasattr(tracker, "state_dict")
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], *, trackers: bool = True) -> None:
        """Inverse of :meth:`state_dict`; ``trackers=False`` keeps the trackers (ranks but
        0: the saved sums are rank 0's, the all-reduce would count them twice)."""
        self.epoch = int(state["epoch"])
        self._step = int(state["optimizer_step"])
        agent_step = state["agent_step"]
        self.agent_step = None if agent_step is None else int(agent_step)
        self._epoch_started = bool(state["epoch_started"])
        self._pending = dict(state["pending"])
        self._logged = dict(state["logged"])
        self._sums = {k: (v[0], int(v[1])) for k, v in state["sums"].items()}
        for part in ("hooks", "sampler", "remedies"):
            getattr(self, part).load_state_dict(state[part])
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        if "reference_states" in state:
            reference = self.context.reference_states
            reference.load_state_dict(state["reference_states"], device)
            reference.forward = reference.forward or self.forward
        for name, saved in state["trackers"].items() if trackers else ():
            tracker = self.context.model_metrics.get(name)
            if tracker is None:
                log.warning(
                    "the saved state holds tracker %r, which this run does not attach", name
                )
                continue
            tracker.load_state_dict(saved, device=device)

    def remove_hooks(self) -> None:
        """Remove every torch hook this session installed (trackers keep their data)."""
        while self._handles:
            self._handles.pop().remove()
        while self._step_hooks:
            self._step_hooks.pop().remove()

    def close(self) -> None:
        """Remove every hook and close the run (idempotent; unemitted metrics are lost)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.remove_hooks()
        finally:
            self.run.close()

    def __enter__(self) -> ProbeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ProbeSession(model={type(self.module).__name__}, run_dir={str(self.run_dir)!r}, "
            f"epoch={self.epoch}, probes={len(self._probes)}, "
            f"hooks={[h.name for h in self.hooks.hooks]}, closed={self.closed})"
        )


def _probeable(
    model: nn.Module,
    components: Mapping[str, nn.Module | str] | None,
    example_inputs: tuple[Any, ...] | None,
) -> PolicyAutoBuilder:
    if isinstance(model, PolicyAutoBuilder):
        if components is not None:
            raise ValueError(
                f"{type(model).__name__} is already a PolicyAutoBuilder with components "
                f"{list(model.components)}; drop components=..."
            )
        policy = model
    else:
        policy = PolicyAutoBuilder.wrap(model, components)
    if example_inputs is not None:
        if not isinstance(example_inputs, tuple):
            raise TypeError("example_inputs must be a tuple of positional arguments")
        with preserved_rng():  # a forward that samples must not move the loop's RNG
            policy.trace_outputs(*example_inputs)
    return policy
