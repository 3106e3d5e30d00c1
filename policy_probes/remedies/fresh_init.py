"""Fresh initial values for a layer, drawn from a remedy's own generator.

A remedy re-initialises with the layer's own initialiser: the module's
``reset_parameters()``, run on a parameter-only twin of the layer (same parameter names,
shapes and dtypes, on the CPU) with the CPU generator seeded with ``seed`` inside
``torch.random.fork_rng``, so the process-wide RNG (CPU and CUDA) is left as it was.
``seed`` is one draw from the remedy's ``torch.Generator``: the values depend on that
generator's state only, so a seeded run re-initialises the same values on every device,
also after a resume.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from policy_probes.remedies.base import Remedy, RemedyTarget
from policy_probes.remedies.structure import layer_units
from policy_probes.torch_internals import own_parameter_twin


def draw_seed(generator: torch.Generator) -> int:
    """The next seed from ``generator`` (one draw)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def fresh_parameters(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``module``'s own parameters (not its children's) as its ``reset_parameters()``
    initialises them with the CPU generator seeded with ``seed``, on the CPU."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise TypeError(
            f"{type(module).__name__} has no reset_parameters(), so it has no initialiser to "
            f"draw fresh values from; leave it out of the remedy"
        )
    twin = own_parameter_twin(module)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        # the CPU generator alone: torch.manual_seed would reseed every CUDA generator too,
        # which fork_rng(devices=[]) does not restore
        torch.default_generator.manual_seed(seed)
        twin.reset_parameters()
    return {name: p.detach() for name, p in twin.named_parameters(recurse=False)}


def check_resettable(remedy: str, layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse a layer without ``reset_parameters()`` (no initialiser to draw from)."""
    for name, module in layers:
        if not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"{remedy}: {name!r} ({type(module).__name__}) has no reset_parameters() to "
                f"draw fresh values from; leave it out of the remedy"
            )


def refresh_layers(
    layers: list[tuple[str, nn.Module]],
    generator: torch.Generator,
    update: Callable[[nn.Parameter, torch.Tensor], None],
) -> dict[str, int]:
    """For every layer, in order: draw its fresh initial values (one seed from
    ``generator``) and call ``update(param, fresh)`` for each of its own parameters, under
    ``no_grad``. Returns the output units of every layer."""
    out: dict[str, int] = {}
    with torch.no_grad():
        for name, module in layers:
            fresh = fresh_parameters(module, draw_seed(generator))
            for pname, param in module.named_parameters(recurse=False):
                update(param, fresh[pname].to(param, non_blocking=True))
            out[name] = layer_units(module)
    return out


class LayerRefresh(Remedy):
    """A remedy that mixes fresh initial values into whole layers: a subclass chooses the
    layers (:meth:`prepare`, a ``[(name, layer)]`` list) and what each parameter becomes
    (:meth:`update`)."""

    def update(self, target: RemedyTarget, param: nn.Parameter, fresh: torch.Tensor) -> None:
        """Change ``param`` given its ``fresh`` initial values (under ``no_grad``)."""
        raise NotImplementedError

    def apply(
        self,
        target: RemedyTarget,
        prepared: list[tuple[str, nn.Module]],
        generator: torch.Generator,
    ) -> dict[str, int]:
        return refresh_layers(prepared, generator, lambda p, f: self.update(target, p, f))
