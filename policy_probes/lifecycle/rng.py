"""Capture and restore every global RNG a training loop uses: torch (CPU and every
initialised CUDA device), numpy's global generator and Python's ``random``."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RNGState:
    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...] | None
    numpy: tuple[Any, ...]
    python: tuple[Any, ...]


def _cuda_in_use() -> bool:
    # Never initialise CUDA just to read its state: an uninitialised device has had no
    # draws, so there is nothing to preserve.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_rng_state() -> RNGState:
    """A copy of the state of every global generator."""
    return RNGState(
        torch_cpu=torch.get_rng_state(),
        torch_cuda=tuple(torch.cuda.get_rng_state_all()) if _cuda_in_use() else None,
        numpy=np.random.get_state(),
        python=random.getstate(),
    )


def restore_rng_state(state: RNGState) -> None:
    """Put every global generator back to ``state`` (the state itself is not consumed)."""
    torch.set_rng_state(state.torch_cpu)
    if state.torch_cuda is not None:
        torch.cuda.set_rng_state_all(list(state.torch_cuda))
    np.random.set_state(state.numpy)
    random.setstate(state.python)


@contextmanager
def preserved_rng() -> Iterator[RNGState]:
    """Run a block and then restore every global generator, also if the block raises."""
    state = capture_rng_state()
    try:
        yield state
    finally:
        restore_rng_state(state)
