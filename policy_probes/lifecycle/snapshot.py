"""TrainingSnapshot: a deep copy of everything an intervention could change (parameters,
buffers, train flags, optimizer and scheduler state, ``param.grad``, every RNG). Restoring
writes back *in place* where the structure still matches, so references the loop holds
(parameters, optimizer state tensors, parameter-group dicts) stay valid."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from policy_probes.lifecycle.rng import RNGState, capture_rng_state, restore_rng_state


@dataclass
class TrainingSnapshot:
    model_state: dict[str, torch.Tensor]
    training_flags: list[bool]
    optimizer_state: dict[str, Any] | None = None
    scheduler_state: dict[str, Any] | None = None
    grads: list[torch.Tensor | None] | None = None
    rng: RNGState | None = None


def capture_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    grads: bool = True,
    rng: bool = True,
) -> TrainingSnapshot:
    """Copy the state of ``model`` (and of the optimizer, scheduler, grads and RNG)."""
    return TrainingSnapshot(
        model_state={k: v.detach().clone() for k, v in model.state_dict().items()},
        training_flags=[m.training for m in model.modules()],
        optimizer_state=copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
        scheduler_state=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        grads=[_clone(p.grad) for p in model.parameters()] if grads else None,
        rng=capture_rng_state() if rng else None,
    )


def restore_training_state(
    snap: TrainingSnapshot,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> None:
    """Write ``snap`` back; the snapshot stays valid for further restores."""
    _restore_model(model, snap.model_state)
    for m, flag in zip(model.modules(), snap.training_flags, strict=False):
        m.training = flag
    if optimizer is not None and snap.optimizer_state is not None:
        restore_optimizer_state(optimizer, snap.optimizer_state)
    if scheduler is not None and snap.scheduler_state is not None:
        scheduler.load_state_dict(copy.deepcopy(snap.scheduler_state))
    if snap.grads is not None:
        _restore_grads(model, snap.grads)
    if snap.rng is not None:
        restore_rng_state(snap.rng)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


@torch.no_grad()
def _restore_model(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    live = model.state_dict()
    if live.keys() != saved.keys() or not all(_same_layout(live[k], v) for k, v in saved.items()):
        model.load_state_dict({k: v.clone() for k, v in saved.items()})
        return
    for k, v in saved.items():
        live[k].copy_(v)


@torch.no_grad()
def _restore_grads(model: nn.Module, saved: list[torch.Tensor | None]) -> None:
    for p, g in zip(model.parameters(), saved, strict=True):
        p.grad = None if g is None else _copied(p.grad, g)


def restore_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load ``saved`` (an ``optimizer.state_dict()`` copy) without consuming it.

    Tensors are copied into the live state tensors and hyperparameters into the live
    parameter-group dicts, so code holding ``optimizer.param_groups[0]`` keeps working.
    Falls back to ``load_state_dict`` on a deep copy when the layout changed."""
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)
    ):
        optimizer.load_state_dict(copy.deepcopy(saved))
        return
    for group, sgroup in zip(groups, saved_groups, strict=True):
        for key, value in sgroup.items():
            if key != "params":
                group[key] = _copied(group.get(key), value)
        for key in [k for k in group if k not in sgroup and k != "params"]:
            del group[key]
    params = [p for g in groups for p in g["params"]]
    restored: dict[torch.Tensor, dict[str, Any]] = {}
    for index, param in enumerate(params):
        pstate = saved["state"].get(index)
        if pstate is not None:
            live = optimizer.state.get(param, {})
            restored[param] = {k: _copied(live.get(k), v) for k, v in pstate.items()}
    optimizer.state.clear()
    optimizer.state.update(restored)


def _copied(current: Any, value: Any) -> Any:
    """``value`` written into ``current`` when their layouts match, else a copy of it."""
    if _same_layout(current, value):
        return current.copy_(value)
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _same_layout(current: Any, value: Any) -> bool:
    return (
        isinstance(current, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and current.shape == value.shape
        and current.dtype == value.dtype
        and current.device == value.device
    )
