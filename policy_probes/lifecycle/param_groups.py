"""A model's parameters grouped by layer and by component (per-layer/-component metrics)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch import nn


def layer_groups(model: nn.Module, trainable: bool = True) -> OrderedDict[str, list[str]]:
    """``layer -> parameter names``: a layer is the module that owns the parameter
    (``actor_mlp.layer_0.linear`` owns ``.weight`` and ``.bias``); a parameter owned by
    the model itself (a Gaussian ``log_std``) is its own group."""
    return _grouped(model, trainable, lambda name, _: name.rpartition(".")[0] or name)


def component_groups(model: nn.Module, trainable: bool = True) -> OrderedDict[str, list[str]]:
    """``component -> parameter names``. For a
    :class:`~policy_probes.components.PolicyAutoBuilder` the components are its named
    components; otherwise the model's direct children. Parameters outside every
    component (``log_std``) form a group named after themselves."""
    comps = getattr(model, "components", None)
    if not isinstance(comps, dict) or not comps:
        comps = OrderedDict(model.named_children())
    owner: dict[int, str] = {}
    for comp, module in comps.items():
        for p in module.parameters():
            owner.setdefault(id(p), comp)
    return _grouped(model, trainable, lambda name, p: owner.get(id(p), name))


def _grouped(
    model: nn.Module, trainable: bool, group_of: Callable[[str, nn.Parameter], str]
) -> OrderedDict[str, list[str]]:
    out: OrderedDict[str, list[str]] = OrderedDict()
    for name, p in model.named_parameters():
        if p.requires_grad or not trainable:
            out.setdefault(group_of(name, p), []).append(name)
    return out
