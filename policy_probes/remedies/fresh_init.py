"""Fresh initial values for a layer from a remedy's own generator: the layer's
``reset_parameters()`` on a parameter-only CPU twin, with the CPU generator seeded with
one draw from the remedy's ``torch.Generator`` inside ``torch.random.fork_rng`` (the
process-wide RNG is left alone; the values are the same on every device and on resume)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from policy_probes.remedies.base import Remedy, RemedyTarget
from policy_probes.remedies.structure import chosen_leaves, layer_units
from policy_probes.torch_internals import own_parameter_twin


def draw_seed(generator: torch.Generator) -> int:
    """The next seed from ``generator`` (one draw)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def fresh_parameters(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``module``'s own parameters as ``reset_parameters()`` draws them from ``seed`` (CPU)."""
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


def resettable_leaves(
    remedy: str, target: RemedyTarget, layers: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """:func:`~.structure.chosen_leaves`, refusing a layer without ``reset_parameters()``
    (no initialiser to draw from)."""
    chosen = chosen_leaves(remedy, target, layers)
    check_resettable(f"{remedy} on {target.component!r}", chosen)
    return chosen


def check_resettable(where: str, layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse a layer without ``reset_parameters()`` (no initialiser to draw from)."""
    for name, module in layers:
        if not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"{where}: {name!r} ({type(module).__name__}) has no reset_parameters() to "
                f"draw fresh values from; leave it out of the remedy"
            )


def refresh_layers(
    layers: list[tuple[str, nn.Module]],
    generator: torch.Generator,
    update: Callable[[nn.Parameter, torch.Tensor], None],
) -> dict[str, int]:
    """For every layer in order, draw fresh values (one seed from ``generator``) and call
    ``update(param, fresh)`` on each of its own parameters under ``no_grad``; returns the
    output units of every layer."""
    out: dict[str, int] = {}
    with torch.no_grad():
        for name, module in layers:
            fresh = fresh_parameters(module, draw_seed(generator))
            for pname, param in module.named_parameters(recurse=False):
                update(param, fresh[pname].to(param, non_blocking=True))
            out[name] = layer_units(module)
    return out


class LayerRefresh(Remedy):
    """A remedy mixing fresh values into the layers :meth:`prepare` chooses (:meth:`update`)."""

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
