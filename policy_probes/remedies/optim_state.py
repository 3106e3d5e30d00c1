"""Optimiser state of the weights a remedy changes: which optimisers are supported, and
how their per-parameter state entries are reset.

Adam and AdamW keep ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with
``amsgrad``) shaped like the parameter, and one ``step`` per parameter tensor; SGD with
momentum keeps ``momentum_buffer``. A remedy that changes some entries of a tensor zeroes
exactly those entries of its moment buffers and leaves ``step`` alone (it counts the
tensor's updates, not the entries'; ReDo's reference implementation resets the moments
only). A remedy that re-initialises a whole tensor also sets its ``step`` to 0, so the
tensor restarts Adam's bias correction as a fresh one would.
"""

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
    """Zero the moment entries of ``param`` at ``index`` along ``dim``; with ``dim=None``
    the whole tensor's state: every moment and ``step``."""
    state = optimizer.state.get(param)
    if not state:
        return  # never stepped: nothing to reset
    for key in MOMENT_KEYS:
        buf = state.get(key)
        if not isinstance(buf, torch.Tensor):
            continue
        if dim is None:
            buf.zero_()
        else:
            buf.index_fill_(dim, index.to(buf.device), 0)
    if dim is None and "step" in state:
        step = state["step"]
        if isinstance(step, torch.Tensor):
            step.zero_()
        else:
            state["step"] = 0
