"""Fresh initial values for a layer, drawn from a remedy's own generator.

A remedy re-initialises with the layer's own initialiser: the module's
``reset_parameters()``, run on a parameter-only twin of the layer (same parameter names,
shapes and dtypes, on the CPU) under ``torch.manual_seed(seed)`` inside
``torch.random.fork_rng``, so the process-wide RNG is left as it was. ``seed`` is one draw
from the remedy's ``torch.Generator``: the values depend on that generator's state only,
so a seeded run re-initialises the same values, also after a resume.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def draw_seed(generator: torch.Generator) -> int:
    """The next seed from ``generator`` (one draw)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def fresh_parameters(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``module``'s own parameters (not its children's) as its ``reset_parameters()``
    initialises them under ``torch.manual_seed(seed)``, on the CPU."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise TypeError(
            f"{type(module).__name__} has no reset_parameters(), so it has no initialiser to "
            f"draw fresh values from; leave it out of the remedy"
        )
    twin = copy.copy(module)  # shallow: the parameter dict is replaced before any write
    twin.__dict__["_parameters"] = {
        name: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
        for name, p in module._parameters.items()
    }
    twin.__dict__["_modules"] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        twin.reset_parameters()
    return {name: p.detach() for name, p in twin._parameters.items() if p is not None}
