"""RLlib (new API stack): probes on every Learner's module, one run directory on the driver
(see ``docs/rllib.md``)::

    from policy_probes.integrations.rllib import probe_config

    config = PPOConfig().environment("CartPole-v1").learners(num_learners=2)
    config = probe_config(config, run_dir="runs/rllib-ppo", probes=["relu@actor_mlp"])
    algo = config.build_algo()
    algo.train()  # one record per training iteration in runs/rllib-ppo
    algo.stop()  # closes the run

Each Learner (local, or a Ray actor) runs a worker :class:`ProbeSession` on its own inner
module (never the DDP wrapper, never the filesystem): the minibatch updates are recorded
with RLlib's ``Columns.LOSS_MASK`` as the row mask, everything else in ``update`` (the GAE
value pass) is not, and the epoch closes at the end of ``update`` on every Learner, with
the trackers all-reduced over RLlib's process group. The driver's
:class:`ProbeRLlibCallback` writes one record per iteration into the run directory and adds
the probe scalars to RLlib's result (``result["learners"][module_id]``).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

try:
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.callbacks.callbacks import RLlibCallback
    from ray.rllib.core.columns import Columns
    from ray.rllib.utils.metrics import (
        ENV_RUNNER_RESULTS,
        LEARNER_RESULTS,
        NUM_ENV_STEPS_SAMPLED_LIFETIME,
    )
except ImportError as exc:  # pragma: no cover - exercised only without ray
    raise ImportError(
        "policy_probes.integrations.rllib needs RLlib: pip install 'ray[rllib]' "
        "(tested with 2.60; see docs/rllib.md)"
    ) from exc

import torch
from torch import nn

from policy_probes.plugins import from_spec
from policy_probes.probe_settings import ProbeSettings
from policy_probes.record_writer import RecordWriter
from policy_probes.run import Run
from policy_probes.session import ProbeSession

log = logging.getLogger("policy_probes")

#: short names -> submodule paths of RLlib's default PPO RLModule
#: (``DefaultPPOTorchRLModule``); a name is offered only when its path exists
#: (``vf_share_layers=True`` has ``shared_mlp``, ``False`` has ``actor_mlp``/``critic_mlp``)
RLLIB_COMPONENTS: dict[str, str] = {
    "actor_mlp": "encoder.actor_encoder.net.mlp",
    "critic_mlp": "encoder.critic_encoder.net.mlp",
    "shared_mlp": "encoder.encoder.net.mlp",
    "actor_head": "pi.net.mlp",
    "critic_head": "vf.net.mlp",
}

#: algorithms whose Learners update asynchronously: refused (docs/rllib.md, Limits)
ASYNC_ALGORITHMS = ("APPO", "IMPALA")

#: the key of the probe settings in ``config.learner_config_dict`` and of the probe state
#: in a Learner's checkpoint state
CONFIG_KEY = "policy_probes"


def rllib_components(
    module: nn.Module, extra: Mapping[str, nn.Module | str] | None = None
) -> dict[str, nn.Module | str]:
    """Component names for an RLModule: every direct child by attribute name, the
    :data:`RLLIB_COMPONENTS` it has, and ``extra`` (which wins)."""
    out: dict[str, nn.Module | str] = {name: name for name, _ in module.named_children()}
    for alias, path in RLLIB_COMPONENTS.items():
        try:
            module.get_submodule(path)
        except AttributeError:
            continue
        out[alias] = path
    out.update(extra or {})
    return out


def rlmodule_forward(module: nn.Module) -> Callable[[torch.Tensor], Any]:
    """Run an RLModule on observation rows as its loss does: ``forward_train`` and, when it
    has a value function, ``compute_values`` on the embeddings that pass returned (the
    forward of the reference states and churn's held-out batch)."""

    def forward(observations: torch.Tensor) -> Any:
        batch = {Columns.OBS: observations}
        out = module.forward_train(batch)  # type: ignore[operator]
        if hasattr(module, "compute_values"):
            embeddings = out.get(Columns.EMBEDDINGS) if isinstance(out, Mapping) else None
            out = {**out, Columns.VF_PREDS: module.compute_values(batch, embeddings=embeddings)}
        return out

    return forward


def probe_config(
    config: AlgorithmConfig,
    *,
    run_dir: str | Path,
    probes: Iterable[str] = (),
    remedies: Iterable[str] = (),
    probing: ProbeSettings | None = None,
    components: Mapping[str, str] | None = None,
    module_id: str | None = None,
    seed: int = 0,
    overwrite: bool = False,
    run_config: Mapping[str, Any] | None = None,
) -> AlgorithmConfig:
    """Make ``config`` probe its Learners and write one run directory; returns ``config``.

    Args:
        config: an RLlib ``AlgorithmConfig`` of the new API stack (PPO: its default learner
            becomes :class:`ProbedPPOTorchLearner`; another learner class must mix in
            :class:`ProbeLearnerMixin` first).
        run_dir: the run directory the driver writes (lock, ``config.json``, sinks).
        probes: probe specs as ``ProbeSettings.probes`` takes them (``"relu@actor_mlp"``,
            ``"fisher@actor_mlp"``); added to ``probing.probes``.
        remedies: remedy specs (``"redo@actor_mlp:every_epochs=5"``); added to
            ``probing.remedies``; fired on every Learner with the same ``seed``.
        probing: the rest of the probe settings (budget, sinks, W&B).
        components: more component names (name -> dotted path in the RLModule).
        module_id: the RLModule to probe (default: the only one).
        seed: the remedies' generator seed, the same on every Learner.
        overwrite: replace a run ``run_dir`` holds (a restored Algorithm continues it).
        run_config: more configuration for ``config.json`` and the W&B run.
    """
    base = probing if probing is not None else ProbeSettings()
    probing = base.model_copy(
        update={
            "probes": [*base.probes, *probes],
            "remedies": [*base.remedies, *remedies],
        }
    )
    ProbeSettings.model_validate(probing.model_dump(mode="json"))  # bad specs fail here
    algo = type(config).__name__.removesuffix("Config")
    if algo in ASYNC_ALGORITHMS:
        raise ValueError(
            f"probe_config: {algo} updates its Learners asynchronously (many update calls "
            f"per iteration, no common point at which every Learner can close an epoch); "
            f"probes support the synchronous PPO Learners only (docs/rllib.md, Limits)"
        )
    learner_class = config.learner_class
    if not issubclass(learner_class, ProbeLearnerMixin):
        if learner_class is not PPOTorchLearner:
            raise TypeError(
                f"probe_config: the learner class {learner_class.__name__} has no probes; "
                f"make one with class Probed{learner_class.__name__}(ProbeLearnerMixin, "
                f"{learner_class.__name__}) and pass it as config.learners(learner_class=...)"
            )
        config.learners(learner_class=ProbedPPOTorchLearner)
    settings = {
        "run_dir": str(run_dir),
        "probing": probing.model_dump(mode="json"),
        "components": dict(components or {}),
        "module_id": module_id,
        "seed": int(seed),
        "overwrite": bool(overwrite),
        "run_config": dict(run_config or {}),
    }
    config.learners(learner_config_dict={CONFIG_KEY: settings})
    callbacks = [c for c in _as_list(config.callbacks_class) if c is not RLlibCallback]
    if ProbeRLlibCallback not in callbacks:
        callbacks.append(ProbeRLlibCallback)
    config.callbacks(callbacks_class=callbacks if len(callbacks) > 1 else callbacks[0])
    return config


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _settings(config: Any) -> dict[str, Any]:
    settings = (getattr(config, "learner_config_dict", None) or {}).get(CONFIG_KEY)
    if settings is None:
        raise ValueError(
            "this Algorithm has no probe settings: build its config with "
            "policy_probes.integrations.rllib.probe_config(config, run_dir=..., probes=[...])"
        )
    return settings


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ProbeLearnerMixin:
    """Probes for an RLlib ``TorchLearner``: ``class ProbedX(ProbeLearnerMixin, X)``.

    After ``build()`` the Learner holds :attr:`probe_session`, a worker
    :class:`ProbeSession` on its inner module (``Run.worker()``: no files). Each minibatch
    update (``_update``) runs in phase ``"train"`` under ``Columns.LOSS_MASK`` as the row
    mask; everything else (the GAE value pass of the learner connector) in ``"rollout"``.
    The end of ``update`` closes the epoch on every Learner (the trackers' all-reduce over
    RLlib's gloo/nccl group) and keeps its metrics in :attr:`probe_metrics`. The session's
    state rides in ``get_state``/``set_state`` under :data:`CONFIG_KEY`.
    """

    probe_session: ProbeSession | None = None
    #: the last closed epoch's metrics (flat keys, plain values, per-unit lists)
    probe_metrics: dict[str, Any] | None = None
    probe_module_id: str | None = None

    def build(self, *args: Any, **kwargs: Any) -> None:
        """RLlib's build (module, optimizers, DDP), then the probe session on the module."""
        super().build(*args, **kwargs)  # type: ignore[misc]
        if self.probe_session is None:
            self.probe_session = self._make_probe_session()

    def _make_probe_session(self) -> ProbeSession:
        settings = _settings(self.config)  # type: ignore[attr-defined]
        ids = list(self.module.keys())  # type: ignore[attr-defined]
        mid = settings["module_id"] or (ids[0] if len(ids) == 1 else None)
        if mid not in ids:
            raise ValueError(
                f"probe_config(module_id=...) must name one of the RLModules {ids}, "
                f"got {settings['module_id']!r}"
            )
        self.probe_module_id = mid
        module = self.module[mid]  # type: ignore[attr-defined]
        inner = module.unwrapped() if hasattr(module, "unwrapped") else module
        probing = ProbeSettings.model_validate(settings["probing"])
        remedies, probing = probing.remedies, probing.model_copy(update={"remedies": []})
        optimizers = self.get_optimizers_for_module(mid)  # type: ignore[attr-defined]
        optimizer = optimizers[0][1] if len(optimizers) == 1 else None
        if remedies and optimizer is None:
            raise ValueError(
                f"remedies {remedies} reset optimizer state for the weights they change; "
                f"module {mid!r} has {len(optimizers)} optimizers, the remedies need exactly one"
            )
        session = ProbeSession(
            inner,
            run=Run.worker(settings["run_dir"]),
            probing=probing,
            components=rllib_components(inner, settings["components"]),
            forward=rlmodule_forward(inner),
            optimizer=optimizer,
        )
        for spec in remedies:  # one seed on every Learner: the same draws, in sync
            component, remedy, _ = from_spec(spec, "remedy")
            session.add_remedy(component, remedy, seed=settings["seed"])
        session.set_phase("rollout")  # until a minibatch update
        return session

    def _make_batch_if_necessary(self, training_data: Any) -> Any:
        """RLlib's train batch (after the learner connector and its value pass); its
        loss-masked observations are the session's rollout (``rollout_end``: the first
        becomes the reference states) when a probe or hook reads observations."""
        batch = super()._make_batch_if_necessary(training_data)  # type: ignore[misc]
        session = self.probe_session
        rows = getattr(batch, "policy_batches", {}).get(self.probe_module_id)
        if session is not None and rows is not None and session.wants_observations:
            obs = rows.get(Columns.OBS)
            mask = rows.get(Columns.LOSS_MASK)
            if isinstance(obs, torch.Tensor):
                kept = obs[mask.to(torch.bool)] if isinstance(mask, torch.Tensor) else obs
                session.rollout_end(observations=kept.detach())
        return batch

    def _update(self, batch: dict[str, Any], **kwargs: Any) -> Any:
        """One minibatch update, recorded: phase ``"train"``, the loss mask as row mask."""
        session = self.probe_session
        if session is None:
            return super()._update(batch, **kwargs)  # type: ignore[misc]
        rows = batch.get(self.probe_module_id)
        mask = rows.get(Columns.LOSS_MASK) if rows is not None else None
        session.set_phase("train")
        try:
            if mask is None:
                return super()._update(batch, **kwargs)  # type: ignore[misc]
            with session.row_mask(mask):
                return super()._update(batch, **kwargs)  # type: ignore[misc]
        finally:
            session.set_phase("rollout")

    def update(self, *args: Any, **kwargs: Any) -> Any:
        """RLlib's update, then the epoch's end (the same point on every Learner)."""
        results = super().update(*args, **kwargs)  # type: ignore[misc]
        session = self.probe_session
        if session is not None:
            timesteps = kwargs.get("timesteps") or {}
            step = int(timesteps.get(NUM_ENV_STEPS_SAMPLED_LIFETIME, 0) or 0)
            epoch = session.record_epoch
            metrics = session.epoch_end(step=step)  # every Learner: a collective
            self.probe_metrics = {"epoch": epoch, "rank": _rank(), "metrics": metrics}
        return results

    def get_state(
        self, components: Any = None, *, not_components: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """RLlib's Learner state and, as a component, the probe session's."""
        state = super().get_state(components, not_components=not_components, **kwargs)  # type: ignore[misc]
        session = self.probe_session
        if session is not None and self._check_component(CONFIG_KEY, components, not_components):  # type: ignore[attr-defined]
            state[CONFIG_KEY] = session.state_dict()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore RLlib's Learner state and the probe session's (tracker sums on rank 0)."""
        super().set_state(state)  # type: ignore[misc]
        saved = state.get(CONFIG_KEY)
        if saved is not None and self.probe_session is not None:
            # ranks but 0: the saved sums are rank 0's, the all-reduce would count them twice
            self.probe_session.load_state_dict(saved, trackers=_rank() == 0)


class ProbedPPOTorchLearner(ProbeLearnerMixin, PPOTorchLearner):
    """RLlib's PPO torch learner with probes (:class:`ProbeLearnerMixin`)."""


def _learner_metrics(learner: Any) -> dict[str, Any] | None:
    return getattr(learner, "probe_metrics", None)


class ProbeRLlibCallback(RLlibCallback):
    """The driver's side: owns the run directory (lock from ``on_algorithm_init`` until
    ``algo.stop()``; ``config.json``, sinks, findings) and writes one record per training
    iteration with the Learners' probe metrics (rank 0's, equal on every Learner after the
    all-reduce) and RLlib's main scalars; adds the probe scalars to
    ``result["learners"][module_id]``.

    A run whose Learners were restored from a checkpoint (their epoch count is past 1 at
    the first iteration of this process) continues ``run_dir``: records after the
    checkpoint's epoch are dropped and the epochs and steps go on from it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.run: Run | None = None
        self.writer: RecordWriter | None = None
        self._warned = False
        #: what was written, one dict per iteration
        self.history: list[dict[str, Any]] = []

    def on_algorithm_init(self, *, algorithm: Any, **kwargs: Any) -> None:
        """Take the run directory's lock; ``algo.stop()`` will close the run."""
        settings = _settings(algorithm.config)
        self.settings = settings
        self.probing = ProbeSettings.model_validate(settings["probing"])
        self.run = Run(settings["run_dir"], overwrite=settings["overwrite"])
        self.run.open(claim=False)  # the lock now; the claim when the first epoch ends
        cleanup = algorithm.cleanup

        def cleanup_and_close() -> None:  # algo.stop() ends the run
            try:
                cleanup()
            finally:
                self.close()

        algorithm.cleanup = cleanup_and_close

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        """Write the iteration's record; add the probe scalars to RLlib's result."""
        reported = [
            r.get() for r in algorithm.learner_group.foreach_learner(_learner_metrics) if r.ok
        ]
        reported = [r for r in reported if r is not None]
        if not reported or self.run is None:
            if not self._warned:
                log.warning(
                    "policy-probes: no Learner reports probe metrics; its class %s lacks "
                    "ProbeLearnerMixin (call probe_config after setting learner_class)",
                    algorithm.config.learner_class.__name__,
                )
                self._warned = True
            return
        first = min(reported, key=lambda r: r["rank"])
        epoch, probe_metrics = int(first["epoch"]), first["metrics"]
        writer = self.writer or self._open(epoch)
        if epoch != writer.epoch + 1:  # restored in this process: go on after its epoch
            writer.rewind(epoch - 1)
        runners = result.get(ENV_RUNNER_RESULTS, {}) or {}
        step = runners.get(
            NUM_ENV_STEPS_SAMPLED_LIFETIME, result.get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
        )
        mid = self.settings["module_id"] or next(iter(_module_ids(result)), "default_policy")
        record = dict(probe_metrics)
        for key in ("episode_return_mean", "episode_len_mean"):
            if _is_number(runners.get(key)):
                record[f"rllib/{key}"] = runners[key]
        learner = (result.get(LEARNER_RESULTS, {}) or {}).get(mid, {}) or {}
        for key in ("total_loss", "policy_loss", "vf_loss", "entropy", "mean_kl_loss"):
            if _is_number(learner.get(key)):
                record[f"train/{key}"] = learner[key]
        written = writer.write(record, step=None if step is None else int(step), epoch=epoch)
        self.history.append({"epoch": epoch, "agent_step": written.agent_step, **written.metrics})
        scalars = {k: v for k, v in probe_metrics.items() if _is_number(v)}
        result.setdefault(LEARNER_RESULTS, {}).setdefault(mid, {}).update(scalars)

    def _open(self, epoch: int) -> RecordWriter:
        """The first record of this process: a fresh run, or one restored Learners go on."""
        run = self.run
        assert run is not None
        if epoch > 1:  # the Learners continue from a checkpoint
            run.resume, run.overwrite = True, False
        run.claim()
        config = {
            "rllib": {"module_id": self.settings["module_id"], "seed": self.settings["seed"]},
            "probing": self.settings["probing"],
            **self.settings["run_config"],
        }
        self.writer = RecordWriter(run, probing=self.probing, config=config)
        return self.writer

    def close(self) -> None:
        """Flush and close the sinks, release the lock (``algo.stop()`` does; idempotent)."""
        if self.writer is not None:
            self.writer.close()
        elif self.run is not None:
            self.run.close()


def _module_ids(result: Mapping[str, Any]) -> list[str]:
    learners = result.get(LEARNER_RESULTS, {}) or {}
    return [k for k in learners if not str(k).startswith("__")]


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


__all__ = [
    "CONFIG_KEY",
    "RLLIB_COMPONENTS",
    "ProbeLearnerMixin",
    "ProbeRLlibCallback",
    "ProbedPPOTorchLearner",
    "probe_config",
    "rllib_components",
    "rlmodule_forward",
]
