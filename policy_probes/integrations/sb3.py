"""Stable-Baselines3: probes on an SB3 policy through :class:`ProbeCallback` (see
``docs/external.md``)::

    callback = ProbeCallback(probes=[("actor_mlp", attach_relu_activation_hooks())])
    PPO("MlpPolicy", "CartPole-v1").learn(100_000, callback=callback)

Each rollout/update cycle is one record of ``train()``'s passes. Component names:
:data:`SB3_COMPONENTS`; ``RecurrentPPO``'s LSTMs are ``lstm_actor``/``lstm_critic``, with the
padded steps its loss masks out masked here too.
"""

from __future__ import annotations

import copy
import logging
import numbers
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

try:
    from stable_baselines3.common.callbacks import BaseCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "policy_probes.integrations.sb3 needs Stable-Baselines3: pip install "
        "policy-probes[sb3] (or pip install stable-baselines3)"
    ) from exc

import numpy as np
import torch
from torch import nn

from policy_probes import ProbeBuilder
from policy_probes.components import ProbeSpec, add_probe
from policy_probes.lifecycle import preserved_rng
from policy_probes.probe_settings import ProbeSettings
from policy_probes.run import Run, default_run_dir, held_outputs, remove_outputs
from policy_probes.session import ProbeSession
from policy_probes.torch_internals import child_modules

#: short names -> submodule paths of SB3's ``ActorCriticPolicy`` (PPO, A2C ``MlpPolicy``);
#: a name is offered only when its path exists on the policy
SB3_COMPONENTS: dict[str, str] = {
    "features": "features_extractor",
    "actor_features": "pi_features_extractor",
    "critic_features": "vf_features_extractor",
    "actor_mlp": "mlp_extractor.policy_net",
    "critic_mlp": "mlp_extractor.value_net",
    "actor_head": "action_net",
    "critic_head": "value_net",
}

#: SB3 hyperparameters copied into the run config when the algorithm has them
_HYPERPARAMETERS = (
    *("learning_rate", "n_steps", "batch_size", "n_epochs", "gamma", "gae_lambda", "ent_coef"),
    *("vf_coef", "max_grad_norm", "clip_range", "normalize_advantage", "target_kl", "n_envs"),
    *("seed", "device", "policy_kwargs"),
)

#: ``(pattern, builder)`` or ``(pattern, builder, placement)``
Probe = tuple[str, ProbeBuilder] | tuple[str, ProbeBuilder, Mapping[str, Any]]

log = logging.getLogger("policy_probes")


def sb3_components(
    policy: nn.Module, extra: Mapping[str, nn.Module | str] | None = None
) -> dict[str, nn.Module | str]:
    """Component names for an SB3 policy: every direct child by attribute name, the
    :data:`SB3_COMPONENTS` it has, and ``extra`` (which wins)."""
    out: dict[str, nn.Module | str] = {}
    for name, child in child_modules(policy):  # every attribute, shared modules included
        if child is not None:
            out[name] = name
    for alias, path in SB3_COMPONENTS.items():
        try:
            policy.get_submodule(path)
        except AttributeError:
            continue
        out[alias] = path
    out.update(extra or {})
    return out


class ProbeCallback(BaseCallback):
    """Attach probes to an SB3 policy, record them during ``train()``, and report once
    per rollout/update cycle to the sinks.

    Args:
        probes: ``(pattern, builder)`` or ``(pattern, builder, placement dict)`` probes.
        backward_probes: backward probes (plain backward hook closures too).
        components: more component names (name -> submodule or dotted path).
        run_dir: where the sinks write; default ``runs/sb3-<algo>-<time>``.
        probing: the :class:`~policy_probes.probe_settings.ProbeSettings` (without
            interventions and ``probe_batch`` schedules: SB3's loss is internal to ``train()``).
        config: the run configuration (``config.json``; SB3's hyperparameters under ``"sb3"``).
        log_sb3: add SB3's logger values of the cycle (``train/*``) and episode statistics.
        verbose: SB3 verbosity; 1 prints the run directory once.
        resume: ``run_dir`` holds the run of an earlier script (the model loaded with
            ``PPO.load`` and ``learn(reset_num_timesteps=False)``): append to its records,
            cycles numbered on from its last one.
        overwrite: ``run_dir`` holds a run to replace (its metrics, checkpoints, W&B files).

    After ``learn()`` the session is closed and :attr:`history` holds every record; a
    later ``learn()`` continues the same ``run_dir`` and cycle count.
    """

    def __init__(
        self,
        probes: Iterable[Probe] = (),
        backward_probes: Iterable[Probe] = (),
        *,
        components: Mapping[str, nn.Module | str] | None = None,
        run_dir: str | Path | None = None,
        probing: ProbeSettings | None = None,
        config: Mapping[str, Any] | None = None,
        log_sb3: bool = True,
        verbose: int = 0,
        resume: bool = False,
        overwrite: bool = False,
    ) -> None:
        super().__init__(verbose)
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other; choose one")
        self.resume, self.overwrite = resume, overwrite
        self.probing = probing if probing is not None else ProbeSettings()
        self._probes: list[ProbeSpec] = []
        for pattern, builder, placement in _pairs(probes, "probes"):
            add_probe(self._probes, pattern, builder, None, placement)
        for pattern, builder, placement in _pairs(backward_probes, "backward_probes"):
            add_probe(self._probes, pattern, builder, True, placement)
        self.components = dict(components or {})
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.user_config = dict(config or {})
        self.log_sb3 = log_sb3
        self.session: ProbeSession | None = None
        #: one dict per reported cycle (what was emitted)
        self.history: list[dict[str, Any]] = []
        self._trained = False  # a train() ran since the last report
        self._masked_buffer: Any = None

    def add_training_hook(
        self, pattern: str, builder: ProbeBuilder, **placement: Any
    ) -> ProbeCallback:
        """Add a probe, placed by its direction and ``placement`` (attached now if it runs)."""
        return self._add(pattern, builder, None, placement)

    def add_training_backward_hook(
        self, pattern: str, builder: ProbeBuilder, **placement: Any
    ) -> ProbeCallback:
        """Add a backward probe (attached when ``learn()`` starts, or now if it runs)."""
        return self._add(pattern, builder, True, placement)

    def _add(
        self, pattern: str, builder: ProbeBuilder, backward: bool | None, placement: dict
    ) -> ProbeCallback:
        if self.session is not None and not self.session.closed:
            _attach(self.session, pattern, builder, backward, placement)
        add_probe(self._probes, pattern, builder, backward, placement)
        return self

    def _init_callback(self) -> None:
        """Called by ``learn()`` before training: wrap the policy and attach the probes."""
        if self.session is not None and not self.session.closed:
            if self.session.module is self.model.policy:
                return  # learn() called again while the session is open
            self.close()
        policy = self.model.policy
        algo = type(self.model).__name__.lower()
        run_dir = self.run_dir = self.run_dir or default_run_dir(f"sb3-{algo}")
        fresh = not self.history and not held_outputs(run_dir)  # a new run of ours
        session = ProbeSession(
            policy,
            # a later learn() goes on; the first follows resume / overwrite
            run=Run(
                run_dir,
                resume=self.resume or bool(self.history),
                overwrite=self.overwrite and not self.history,
            ),
            probing=self.probing,
            components=sb3_components(policy, self.components),
            config={"sb3": self._hyperparameters(), **self.user_config},
            optimizer=getattr(policy, "optimizer", None),
        )
        try:
            self._trace(session)
            for pattern, builder, backward, placement in self._probes:
                _attach(session, pattern, builder, backward, placement)
        except BaseException:
            session.close()
            if fresh:  # a failed start leaves nothing that blocks the corrected script
                remove_outputs(run_dir)
            raise
        session.set_phase("rollout")
        self.session = session
        self._mask_minibatches(session)
        self._trained = False
        if self.verbose >= 1:
            print(f"policy-probes: writing to {run_dir}")

    def _on_rollout_start(self) -> None:
        """Report the previous cycle, then stop recording."""
        self._report()
        if self.session is not None:
            self.session.set_phase("rollout")

    def _on_rollout_end(self) -> None:
        """``train()`` comes next: the session's ``rollout_end``, then record from here."""
        session = self.session
        if session is not None:
            observations = _buffer_observations(self.model) if session.wants_observations else None
            session.rollout_end(observations=observations, agent_step=self.model.num_timesteps)
            session.set_phase("train")
            self._trained = True

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        """Report the last cycle and close the session."""
        try:
            self._report()
        finally:
            self.close()

    def _report(self) -> None:
        """Report the cycle that just trained."""
        if self.session is None or self.session.closed or not self._trained:
            return
        self._trained = False
        start = time.perf_counter()
        if self.log_sb3:
            self.session.log(self._sb3_values())
        logged = time.perf_counter() - start
        self.session.set_phase("rollout")
        self.history.append(self.session.epoch_end(step=int(self.model.num_timesteps)))
        sampler = self.session.context.sampler
        if sampler is not None:  # the callback's own work, for the probes
            sampler.charge(logged)

    def _sb3_values(self) -> dict[str, float]:
        """SB3's logger values since its last dump (``train/*``) and the episode statistics
        of its episode buffer, as ``dump_logs`` computes them."""
        out: dict[str, float] = {}
        logger = getattr(self.model, "_logger", None)
        for key, value in dict(getattr(logger, "name_to_value", {}) or {}).items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                out[key] = float(value)
        episodes = getattr(self.model, "ep_info_buffer", None)
        if episodes:
            out["rollout/ep_rew_mean"] = float(sum(e["r"] for e in episodes) / len(episodes))
            out["rollout/ep_len_mean"] = float(sum(e["l"] for e in episodes) / len(episodes))
        return out

    def _trace(self, session: ProbeSession) -> None:
        """Trace one forward pass on a sample observation, so that a backward probe on a
        component returning a tuple fails when attached (else at its first forward)."""
        policy = self.model.policy
        try:
            space = copy.deepcopy(policy.observation_space)  # keep the space's own RNG
            obs, _ = policy.obs_to_tensor(space.sample())
            args = _forward_args(policy, obs)
        except Exception:  # exotic spaces: kinds stay unknown, checked on first forward
            return
        try:
            with preserved_rng():  # trace_outputs runs in eval mode and restores the modes
                session.policy.trace_outputs(*args)
        except TypeError as exc:
            log.warning(
                "policy-probes: not tracing %s (%s); a backward probe on a component that "
                "returns a tuple or mapping fails at its first forward instead of when attached",
                type(policy).__name__,
                exc,
            )

    def _mask_minibatches(self, session: ProbeSession) -> None:
        """Use each minibatch's ``mask`` (recurrent buffers: 0 at padded steps) as the row
        mask while ``train()`` uses it: the buffer's ``get`` wrapped until :meth:`close`."""
        buffer = getattr(self.model, "rollout_buffer", None)
        get = getattr(buffer, "get", None)
        if buffer is None or get is None or "get" in vars(buffer):
            return

        def masked_get(*args: Any, **kwargs: Any) -> Any:
            for sample in get(*args, **kwargs):
                mask = getattr(sample, "mask", None)
                if not isinstance(mask, torch.Tensor) or session.closed:
                    yield sample
                    continue
                with session.row_mask(_sequence_mask(mask, sample)):
                    yield sample

        buffer.get = masked_get
        self._masked_buffer = buffer

    def _hyperparameters(self) -> dict[str, Any]:
        out: dict[str, Any] = {"algo": type(self.model).__name__}
        out["policy"] = type(self.model.policy).__name__
        for name in _HYPERPARAMETERS:
            value = getattr(self.model, name, None)
            if value is None:
                continue
            if callable(value):  # schedules
                value = getattr(value, "__name__", type(value).__name__)
            if not isinstance(value, bool | int | float | str):
                value = str(value)
            out[name] = value
        return out

    def close(self) -> None:
        """Remove the hooks and close the sinks (``learn()``'s end does; call it, or use the
        callback as a context manager, if ``learn()`` may raise)."""
        buffer = getattr(self, "_masked_buffer", None)
        if buffer is not None:
            vars(buffer).pop("get", None)
            self._masked_buffer = None
        if self.session is not None:
            self.session.close()

    def __enter__(self) -> ProbeCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buffer_observations(model: Any) -> torch.Tensor | None:
    """The rollout buffer's observations as flat rows on the model's device (None for
    dict spaces: the churn probe then needs ``ChurnState.fix_batch``)."""
    obs = getattr(getattr(model, "rollout_buffer", None), "observations", None)
    if not isinstance(obs, np.ndarray):
        return None
    rows = obs.reshape(-1, *obs.shape[2:])
    return torch.as_tensor(rows, device=model.device).float()


def _forward_args(policy: nn.Module, obs: Any) -> tuple[Any, ...]:
    """Arguments for one forward of ``policy`` on a single observation ``obs``."""
    shape = getattr(policy, "lstm_hidden_state_shape", None)
    if shape is None:
        return (obs,)
    from sb3_contrib.common.recurrent.type_aliases import RNNStates

    device = next(policy.parameters()).device

    def zeros() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    return obs, RNNStates(zeros(), zeros()), torch.ones(1, device=device)


def _sequence_mask(mask: torch.Tensor, sample: Any) -> torch.Tensor:
    """A recurrent minibatch's flat mask as ``(sequences, steps)`` (a per-step call: a column)."""
    states = getattr(sample, "lstm_states", None)
    pi = getattr(states, "pi", None)
    if pi is None:
        return mask
    n_seq = pi[0].shape[1]
    return mask.reshape(n_seq, -1) if n_seq and mask.numel() % n_seq == 0 else mask


def _attach(
    session: ProbeSession,
    pattern: str,
    builder: ProbeBuilder,
    backward: bool | None,
    placement: dict,
) -> None:
    """Attach through the session's public methods, as any loop does."""
    add = session.add_training_backward_hook if backward else session.add_training_hook
    add(pattern, builder, **placement)


def _pairs(items: Iterable[Probe], what: str) -> list[tuple[str, ProbeBuilder, dict]]:
    out = []
    for item in items:
        ok = isinstance(item, tuple | list) and len(item) in (2, 3) and isinstance(item[0], str)
        if not ok or (len(item) == 3 and not isinstance(item[2], Mapping)):
            raise TypeError(
                f"{what} must hold (pattern, builder) pairs such as ('actor_mlp', "
                f"attach_relu_activation_hooks()), or (pattern, builder, placement) with a "
                f"placement dict such as {{'per_layer': False}}; got {item!r}"
            )
        out.append((item[0], item[1], dict(item[2]) if len(item) == 3 else {}))
    return out


__all__ = ["SB3_COMPONENTS", "ProbeCallback", "sb3_components"]
