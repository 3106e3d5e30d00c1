"""TorchRL: a :class:`ProbeSession` driven by TorchRL's ``Trainer`` (see ``docs/external.md``)::

    trainer = PPOTrainer(collector=..., loss_module=loss, optimizer=opt, ...)
    with ProbeSession(nn.ModuleDict({"actor": actor, "critic": critic}), ...) as session:
        session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        hook = ProbeTrainerHook(session)
        hook.register(trainer)  # its ops, and its state in the trainer's checkpoints
        trainer.train()

One record per collected batch: the probes record the loss module's passes of the
optimization loop only (collection and the advantage pass run in the ``"rollout"`` phase).
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from tensordict import TensorDictBase
    from torchrl.trainers import Trainer, TrainerHookBase
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "policy_probes.integrations.torchrl needs TorchRL: pip install policy-probes[torchrl] "
        "(or pip install torchrl)"
    ) from exc

import torch
from torch import nn

from policy_probes.session import ProbeSession

log = logging.getLogger("policy_probes")


class ProbeTrainerHook(TrainerHookBase):
    """Drive a :class:`ProbeSession` from TorchRL's ``Trainer`` (``PPOTrainer`` and any
    trainer whose optimization loop runs in this process).

    Args:
        session: the session on the trainer's modules (probes attached before
            :meth:`register`, or at any time after).
        log_losses: add the loss module's scalar outputs (``loss_objective``,
            ``clip_fraction``, ...) to each record as means over the batch's optimizer steps.
        prefix: the prefix of those keys (and of ``optim_steps``).
        observation_key: the collected batch's observation entry, handed to
            :meth:`ProbeSession.rollout_end` when a probe or hook reads observations.

    :attr:`history` holds every record this hook emitted.
    """

    def __init__(
        self,
        session: ProbeSession,
        *,
        log_losses: bool = True,
        prefix: str = "train/",
        observation_key: Any = "observation",
    ) -> None:
        if not isinstance(session, ProbeSession):
            raise TypeError(
                f"ProbeTrainerHook needs a ProbeSession, got {type(session).__name__}: build "
                f"one on the trainer's modules, e.g. ProbeSession(nn.ModuleDict({{'actor': "
                f"actor, 'critic': critic}}), components=...)"
            )
        self.session = session
        self.log_losses = log_losses
        self.prefix = prefix
        self.observation_key = observation_key
        #: one dict per record emitted (one per collected batch that trained)
        self.history: list[dict[str, Any]] = []
        self.trainer: Trainer | None = None
        self._steps = 0  # optimizer steps since the last record
        self._ends_passes = False  # no optimizer bound: post_optim ends the passes
        self._loss_handle: Any = None

    def register(self, trainer: Trainer, name: str = "policy_probes") -> None:
        """Register the ops (where each runs: ``docs/external.md``) and this hook as the
        trainer's module ``name``, so that its ``state_dict`` rides in the checkpoints."""
        if self.trainer is not None:
            raise RuntimeError("this ProbeTrainerHook is already registered with a trainer")
        if getattr(trainer, "learner_backend", "local") != "local":
            raise ValueError(
                f"ProbeTrainerHook needs the optimization loop in this process; the trainer "
                f"has learner_backend={trainer.learner_backend!r}, whose learners run "
                f"elsewhere. Use learner_backend='local'"
            )
        session = self.session
        optimizer = getattr(trainer, "optimizer", None)
        if session.optimizer is None and session.model_context is None and optimizer is not None:
            session.bind(optimizer)  # its steps end the probes' passes
        self._ends_passes = session.optimizer is None
        trainer.register_module(name, self)
        trainer.register_op("setup", self._setup)
        trainer.register_op("batch_process", self._batch_process)
        trainer.register_op("pre_epoch_log", self._pre_epoch)
        trainer.register_op("process_optim_batch", self._train)
        trainer.register_op("post_optim", self._post_optim)
        trainer.register_op("post_steps", self._post_steps)
        trainer.register_op("shutdown", self._shutdown)
        loss_module = getattr(trainer, "loss_module", None)
        if self.log_losses and isinstance(loss_module, nn.Module):
            self._loss_handle = loss_module.register_forward_hook(self._loss_values)
        self.trainer = trainer

    @property
    def _open(self) -> bool:
        return not self.session.closed

    def _setup(self) -> None:
        """``setup``: training starts; the collection runs in the rollout phase."""
        if self._open:
            self.session.set_phase("rollout")

    def _batch_process(self, batch: TensorDictBase) -> None:
        """``batch_process``: a batch was collected (its observations to the session)."""
        session = self.session
        if not self._open:
            return
        session.set_phase("rollout")
        if session.wants_observations:
            session.rollout_end(
                observations=self._observations(batch),
                agent_step=int(self.trainer.collected_frames) if self.trainer else None,
            )

    def _pre_epoch(self, batch: TensorDictBase | None) -> None:
        """``pre_epoch_log``: each of the trainer's epochs starts; the ``pre_epoch`` ops that
        follow (the advantage pass over the whole batch) are not training."""
        if self._open:
            self.session.set_phase("rollout")

    def _train(self, batch: TensorDictBase) -> None:
        """``process_optim_batch``: a minibatch goes to the loss; the probes record."""
        if self._open:
            self.session.set_phase("train")

    def _post_optim(self) -> None:
        """``post_optim``: after each optimizer step (the bound optimizer's step already ended
        the probes' pass; without one, this does)."""
        session = self.session
        if not self._open:
            return
        if self._ends_passes:
            session.next_pass()
        if session.wants_steps:
            session.post_step()
        else:
            session.optimizer_step += 1
        self._steps += 1

    def _post_steps(self) -> None:
        """``post_steps``: the batch's optimization is done; one record (none before the
        first optimizer step, e.g. during ``init_random_frames``)."""
        session = self.session
        if not self._open or self._steps == 0:
            return
        session.set_phase("rollout")
        frames = int(self.trainer.collected_frames) if self.trainer else 0
        record = session.epoch_end(step=frames, **{f"{self.prefix}optim_steps": self._steps})
        self._steps = 0
        self.history.append(record)

    def _shutdown(self) -> None:
        """``shutdown``: training ends; every record is in the sinks."""
        if self._open:
            self.session.sinks.flush()

    def _loss_values(self, _module: nn.Module, _args: Any, out: Any) -> None:
        """The loss module's scalars of a training pass, as means over the record's steps."""
        if not self._open or self.session.current_phase != "train":
            return
        if not isinstance(out, TensorDictBase):
            return
        values = {
            f"{self.prefix}{key}": value
            for key, value in out.items()
            if isinstance(key, str)
            and isinstance(value, torch.Tensor)
            and value.numel() == 1
            and value.is_floating_point()
        }
        if values:
            self.session.log(values, reduce="mean")

    def _observations(self, batch: TensorDictBase) -> torch.Tensor | None:
        obs = batch.get(self.observation_key, None)
        if not isinstance(obs, torch.Tensor):
            log.warning(
                "policy-probes: the collected batch has no %r tensor; pass "
                "ProbeTrainerHook(observation_key=...) for probes that read observations",
                self.observation_key,
            )
            return None
        return obs.flatten(0, batch.batch_dims - 1) if batch.batch_dims > 1 else obs

    def state_dict(self) -> dict[str, Any]:
        """The session's state (the trainer saves it with its own)."""
        return {"session": self.session.state_dict(), "steps": self._steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the session (its probes attached first): the run continues its epochs."""
        self.session.load_state_dict(state_dict["session"])
        self._steps = int(state_dict.get("steps", 0))

    def close(self) -> None:
        """Remove the loss module's forward hook (the trainer's ops become no-ops once the
        session is closed)."""
        if self._loss_handle is not None:
            self._loss_handle.remove()
            self._loss_handle = None


__all__ = ["ProbeTrainerHook"]
