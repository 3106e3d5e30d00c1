"""ModelDataContext: what an intervention may do to the model and the current data (it
reaches the optimizer and the data only through it); :class:`LoopModelDataContext`
implements it for any minibatch loop (the PPO trainer and ProbeSession build on it)."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from policy_probes.lifecycle.snapshot import (
    TrainingSnapshot,
    capture_training_state,
    restore_training_state,
)

Grads = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Any], Any]


class ModelDataContext(ABC):
    """What an intervention may do; the manager's guardian checkpoint undoes it afterwards."""

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The policy (the live module; changes are undone by the guardian)."""

    @property
    def device(self) -> torch.device:
        return device_of(self.model)

    @property
    def update_epochs(self) -> int:
        """How many update epochs the loop's real update phase runs."""
        return 1

    def named_parameters(self) -> OrderedDict[str, nn.Parameter]:
        """The trainable parameters, in ``model.named_parameters()`` order."""
        return OrderedDict((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    @abstractmethod
    def save_checkpoint(self, full: bool = True) -> int:
        """Copy model and gradients (``full``: also optimizer, scheduler, every RNG); a token."""

    @abstractmethod
    def restore_checkpoint(self, token: int) -> None:
        """Write the state saved under ``token`` back (the token stays valid)."""

    @abstractmethod
    def discard_checkpoint(self, token: int) -> None:
        """Free the state saved under ``token``."""

    @abstractmethod
    def capture_pre_epoch(self) -> None:
        """Remember model, optimizer and scheduler at PRE_EPOCH (``needs_pre_epoch_state``)."""

    @abstractmethod
    def restore_pre_epoch(self) -> None:
        """Put model, optimizer and scheduler back to their state at PRE_EPOCH."""

    @abstractmethod
    def minibatches(self, order: Any = None) -> Iterator[Any]:
        """The current data as minibatches in ``order`` (``None``: natural order)."""

    @abstractmethod
    def random_order(self, generator: torch.Generator | None = None) -> Any:
        """A random ``order`` for :meth:`minibatches` (default: from the global torch RNG)."""

    def get_shuffled_loader(self) -> list[Any]:
        """The current data in a random minibatch order."""
        return list(self.minibatches(self.random_order()))

    @abstractmethod
    def observations(self) -> torch.Tensor:
        """Every observation of the current data, ``(samples, *obs_shape)``."""

    @abstractmethod
    def compute_loss(self, batch: Any = None) -> torch.Tensor:
        """The training loss (with graph) on ``batch``; ``None``: size-weighted on all data."""

    @abstractmethod
    def compute_batch_gradients(self, batch: Any = None) -> Grads:
        """Gradients of the loss on one minibatch (``None``: the first); ``param.grad`` kept."""

    @abstractmethod
    def compute_gradients(self) -> Grads:
        """Gradients of the loss on all the current data, no optimizer step."""

    @abstractmethod
    def run_training_epoch(self, order: Any = None, step: bool = True) -> Grads:
        """One update epoch in ``order`` as the loop runs it; the mean pre-clip gradients."""

    @abstractmethod
    def apply_perturbation(
        self, direction: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], scale: float
    ) -> None:
        """``theta <- theta + scale * direction`` (by parameter name or in order)."""

    @abstractmethod
    def sample_actions(self, obs: torch.Tensor) -> torch.Tensor:
        """Actions drawn from the policy's action distribution at ``obs``."""

    @abstractmethod
    def action_log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)`` per sample, differentiable in the parameters."""


def batch_size(batch: Any) -> int:
    """Samples in a minibatch: first dimension of its (first) tensor, or ``len(batch)``."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                return batch_size(v)
    if isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor):
        return batch_size(batch[0])
    try:
        return len(batch)
    except TypeError:
        return 1


def batch_field(batch: Any, key: str) -> Any:
    """``batch[key]`` for mappings, ``batch.key`` for objects, the batch for a tensor."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        return batch[key]
    if hasattr(batch, key):
        return getattr(batch, key)
    raise KeyError(
        f"cannot find {key!r} in a minibatch of type {type(batch).__name__}; pass obs_key=... "
        f"to LoopModelDataContext"
    )


def _index(data: Any, idx: torch.Tensor) -> Any:
    if isinstance(data, torch.Tensor):
        return data[idx]
    if isinstance(data, Mapping):
        return {k: _index(v, idx) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    if isinstance(data, tuple | list):
        return type(data)(_index(v, idx) for v in data)
    raise TypeError(
        f"LoopModelDataContext(data=...) must be a tensor, a mapping or a tuple of tensors, "
        f"got {type(data).__name__}; pass minibatches=[...] for other batch types"
    )


def _join(batches: list[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return {
            k: torch.cat([b[k] for b in batches]) if isinstance(v, torch.Tensor) else v
            for k, v in first.items()
        }
    if isinstance(first, tuple | list):
        return type(first)(_join([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(
        f"cannot join minibatches of type {type(first).__name__} into one batch; pass "
        f"data=... with minibatch_size instead of minibatches=[...]"
    )


class LoopModelDataContext(ModelDataContext):
    """A :class:`ModelDataContext` for any loop of minibatch gradient steps.

    ``loss_fn(model, batch) -> loss`` (or ``(loss, ...)``) is the exact loss the loop
    trains with (mean over the minibatch). The current data is either ``minibatches`` (an
    ``order`` is then a sequence of minibatch indices) or one batch ``data`` (tensor,
    mapping or tuple of tensors, samples first) with ``minibatch_size`` (an ``order`` is a
    permutation of sample indices cut into consecutive minibatches, as PPO does).
    ``max_grad_norm``: global gradient-norm clipping before ``optimizer.step()``;
    ``obs_key``: where a minibatch holds the observations (key or attribute);
    ``sample_fn(model, obs)``, ``log_prob_fn(model, obs, actions)``: the action
    distribution (for ``policy_fisher``; default: the model's ``get_distribution(obs)``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        minibatches: Sequence[Any] | None = None,
        data: Any = None,
        minibatch_size: int | None = None,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        update_epochs: int = 1,
        obs_key: str = "obs",
        sample_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
        log_prob_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self._model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.max_grad_norm = loss_fn, max_grad_norm
        self._update_epochs = int(update_epochs)
        self.obs_key, self.sample_fn, self.log_prob_fn = obs_key, sample_fn, log_prob_fn
        self._checkpoints: dict[int, TrainingSnapshot] = {}
        self._tokens = itertools.count()
        self._pre_epoch: TrainingSnapshot | None = None
        self.set_data(minibatches=minibatches, data=data, minibatch_size=minibatch_size)

    def set_data(
        self,
        *,
        minibatches: Sequence[Any] | None = None,
        data: Any = None,
        minibatch_size: int | None = None,
    ) -> None:
        """Point the context at the current epoch's data (one of the two forms)."""
        if minibatches is not None and data is not None:
            raise ValueError(
                "give either minibatches=[...] or data=... with minibatch_size, not both"
            )
        if data is not None and (minibatch_size is None or minibatch_size < 1):
            raise ValueError("data=... needs minibatch_size=<positive int>")
        self._minibatches, self._data, self._minibatch_size = minibatches, data, minibatch_size

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def update_epochs(self) -> int:
        return self._update_epochs

    def save_checkpoint(self, full: bool = True) -> int:
        token = next(self._tokens)
        optimizer, scheduler = (self.optimizer, self.scheduler) if full else (None, None)
        self._checkpoints[token] = capture_training_state(
            self.model, optimizer, scheduler, rng=full
        )
        return token

    def restore_checkpoint(self, token: int) -> None:
        if token not in self._checkpoints:
            raise KeyError(
                f"no checkpoint with token {token!r} (discarded or never saved); live tokens: "
                f"{sorted(self._checkpoints)}"
            )
        snapshot = self._checkpoints[token]
        restore_training_state(snapshot, self.model, self.optimizer, self.scheduler)

    def discard_checkpoint(self, token: int) -> None:
        self._checkpoints.pop(token, None)

    def capture_pre_epoch(self) -> None:
        self._pre_epoch = capture_training_state(
            self.model, self.optimizer, self.scheduler, grads=False, rng=False
        )

    def restore_pre_epoch(self) -> None:
        if self._pre_epoch is None:
            raise RuntimeError(
                "no pre-epoch state was captured: declare needs_pre_epoch_state = True on the "
                "hook and make the loop fire PRE_EPOCH with this model context"
            )
        restore_training_state(self._pre_epoch, self.model, self.optimizer, self.scheduler)

    def _require_data(self) -> None:
        if self._minibatches is None and self._data is None:
            raise RuntimeError(
                "this model context has no current data; call set_data(minibatches=...) or "
                "set_data(data=..., minibatch_size=...) after each rollout"
            )

    def num_samples(self) -> int:
        self._require_data()
        if self._data is not None:
            return batch_size(self._data)
        return sum(batch_size(b) for b in self._minibatches)

    def random_order(self, generator: torch.Generator | None = None) -> Any:
        self._require_data()
        if self._data is not None:
            return torch.randperm(self.num_samples(), generator=generator)
        return torch.randperm(len(self._minibatches), generator=generator).tolist()

    def minibatches(self, order: Any = None) -> Iterator[Any]:
        self._require_data()
        if self._data is not None:
            n = self.num_samples()
            idx = torch.arange(n) if order is None else torch.as_tensor(order)
            for chunk in torch.split(idx, self._minibatch_size):
                yield _index(self._data, chunk.to(device_of(self._data)))
            return
        indices = range(len(self._minibatches)) if order is None else order
        for i in indices:
            yield self._minibatches[int(i)]

    def rows(self, idx: torch.Tensor) -> Any:
        """Samples ``idx`` (numbered as :meth:`random_order` numbers them) as one batch."""
        self._require_data()
        data = self._data if self._data is not None else _join(list(self._minibatches))
        return _index(data, idx.to(device_of(data)))

    def observations(self) -> torch.Tensor:
        self._require_data()
        if self._data is not None:
            return batch_field(self._data, self.obs_key)
        return torch.cat([batch_field(b, self.obs_key) for b in self._minibatches])

    def loss(self, batch: Any) -> torch.Tensor:
        """``loss_fn(model, batch)``, unwrapping ``(loss, stats)`` results."""
        out = self.loss_fn(self.model, batch)
        return out[0] if isinstance(out, tuple | list) else out

    def compute_loss(self, batch: Any = None) -> torch.Tensor:
        if batch is not None:
            return self.loss(batch)
        total = self.num_samples()
        return sum(self.loss(b) * (batch_size(b) / total) for b in self.minibatches())

    def _grads_of(self, loss: torch.Tensor) -> Grads:
        params = self.named_parameters()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        return {
            n: torch.zeros_like(p) if g is None else g
            for (n, p), g in zip(params.items(), grads, strict=True)
        }

    def compute_batch_gradients(self, batch: Any = None) -> Grads:
        if batch is None:
            batch = next(self.minibatches())
        return self._grads_of(self.loss(batch))

    def compute_gradients(self) -> Grads:
        total = self.num_samples()
        acc: Grads = {}
        for b in self.minibatches():
            w = batch_size(b) / total
            for n, g in self._grads_of(self.loss(b)).items():
                acc[n] = acc[n].add_(g, alpha=w) if n in acc else g * w
        return acc

    def train_minibatch(self, batch: Any, step: bool = True) -> list[torch.Tensor | None]:
        """One gradient step exactly as the loop takes it; the gradients before clipping in
        :meth:`named_parameters` order. Override for micro-batching or other details."""
        params = list(self.named_parameters().values())
        self.optimizer.zero_grad()
        self.loss(batch).backward()
        grads = [p.grad for p in params]
        if self.max_grad_norm is not None:
            grads = [None if g is None else g.detach().clone() for g in grads]
            nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if step:
            self.optimizer.step()
        return grads

    def run_training_epoch(self, order: Any = None, step: bool = True) -> Grads:
        params = self.named_parameters()
        total = self.num_samples()
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for b in self.minibatches(order):
            grads = self.train_minibatch(b, step=step)
            w = batch_size(b) / total
            for n, g in zip(params, grads, strict=True):
                if g is not None:
                    acc[n].add_(g, alpha=w)
        return acc

    @torch.no_grad()
    def apply_perturbation(
        self, direction: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], scale: float
    ) -> None:
        params = self.named_parameters()
        if isinstance(direction, Mapping):
            unknown = set(direction) - set(params)
            if unknown:
                raise KeyError(f"perturbation names unknown parameters {sorted(unknown)}")
            pairs = [(params[n], d) for n, d in direction.items()]
        else:
            direction = list(direction)
            if len(direction) != len(params):
                raise ValueError(
                    f"perturbation has {len(direction)} tensors, the model {len(params)} "
                    f"trainable parameters"
                )
            pairs = list(zip(params.values(), direction, strict=True))
        for p, d in pairs:
            p.add_(d.to(p.device, p.dtype), alpha=scale)

    def _distribution(self, obs: torch.Tensor) -> Any:
        get = getattr(self.model, "get_distribution", None)
        if get is None:
            raise TypeError(
                f"{type(self.model).__name__} has no get_distribution(obs); pass sample_fn= and "
                f"log_prob_fn= to LoopModelDataContext (or subclass it) so policy_fisher can "
                f"sample actions and score them"
            )
        return get(obs)

    def sample_actions(self, obs: torch.Tensor) -> torch.Tensor:
        if self.sample_fn is not None:
            return self.sample_fn(self.model, obs)
        return self._distribution(obs).sample()

    def action_log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        if self.log_prob_fn is not None:
            return self.log_prob_fn(self.model, obs, actions)
        return self._distribution(obs).log_prob(actions)


def device_of(obj: Any) -> torch.device:
    """The device of a tensor, module, mapping or sequence (its first tensor), else the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, nn.Module):
        obj = obj.parameters()
    elif isinstance(obj, Mapping):
        obj = obj.values()
    values = () if obj is None else obj
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
