"""Optimiser state of the weights a remedy changes: the supported optimisers and how their
per-parameter entries are reset. Changing some entries of a tensor zeroes exactly those
moment entries and keeps ``step`` (as ReDo's reference code does); re-initialising a
whole tensor also sets ``step`` to 0, restarting Adam's bias correction."""

from __future__ import annotations

import torch

#: optimisers whose per-parameter state the remedies know how to reset
SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)

#: the state entries shaped like their parameter
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """``optimizer`` if its state can be reset, else a ``TypeError`` naming what is."""
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
        raise TypeError(
            f"remedies reset the optimiser state of the weights they change, which they can do "
            f"for {names} (with or without momentum); this run uses "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    return optimizer  # type: ignore[return-value]


def reset_entries(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    dim: int | None = None,
    index: torch.Tensor | None = None,
) -> None:
    """Zero ``param``'s moment entries at ``index`` along ``dim`` (``None``: all, and ``step``)."""
    state = optimizer.state.get(param)
    if not state:
        return  # never stepped: nothing to reset
    for key in MOMENT_KEYS:
        buf = state.get(key)
        if isinstance(buf, torch.Tensor) and dim is None:
            buf.zero_()
        elif isinstance(buf, torch.Tensor):
            buf.index_fill_(dim, index.to(buf.device), 0)
    if dim is None and "step" in state:
        if isinstance(state["step"], torch.Tensor):
            state["step"].zero_()
        else:
            state["step"] = 0
