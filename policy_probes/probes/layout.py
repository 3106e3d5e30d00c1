"""Which axis of a probed tensor holds the units: channels first (conv) or last (dense).

Probes read ``(samples, units)``: a dense output's units are last, a convolution's
``(B, C, *spatial)`` on axis 1, every (sample, position) a row. The ``layout`` keyword:

* ``"channels_last"``: units on the last axis.
* ``"channels_first"``: units on axis 1 for tensors of 3 or more dimensions.
* ``"auto"`` (default), decided at attach from the module types: a conv, pooling or
  batch/instance/group norm module is channels first; an elementwise module (activation,
  dropout, identity) takes the layout of the module before it (its previous sibling, then
  its parent's, ...); a container that of its last non-elementwise child; any other
  module (``nn.Linear``, ``nn.Flatten``, custom leaves) is channels last.

Tensors of 2 or fewer dimensions read the same under every layout. The channels-first
view is taken in the hook (``movedim``: no copy); the rows are materialised at the drain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.nn.modules import activation, batchnorm, conv, dropout, instancenorm, pooling

from policy_probes.probes.state import as_rows
from policy_probes.torch_internals import child_modules

Layout = Literal["auto", "channels_first", "channels_last"]
LAYOUTS: tuple[str, ...] = ("auto", "channels_first", "channels_last")

#: modules whose output has its channels on axis 1
CHANNEL_MODULES: tuple[type[nn.Module], ...] = (
    conv._ConvNd,
    pooling._MaxPoolNd,
    pooling._AvgPoolNd,
    pooling._AdaptiveAvgPoolNd,
    pooling._AdaptiveMaxPoolNd,
    pooling._LPPoolNd,
    batchnorm._BatchNorm,
    instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
)

#: elementwise activation modules (the "activation layers" of the per-layer probes)
ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    activation.ReLU,
    activation.ReLU6,
    activation.LeakyReLU,
    activation.PReLU,
    activation.RReLU,
    activation.ELU,
    activation.SELU,
    activation.CELU,
    activation.GELU,
    activation.SiLU,
    activation.Mish,
    activation.Tanh,
    activation.Sigmoid,
    activation.Hardtanh,
    activation.Hardswish,
    activation.Hardsigmoid,
    activation.Softplus,
    activation.Softsign,
    activation.Tanhshrink,
    activation.LogSigmoid,
    activation.Threshold,
)

#: modules that keep their input's shape and layout
ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    *ACTIVATION_MODULES,
    dropout._DropoutNd,
    nn.Identity,
)


def check_layout(layout: str) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ``ValueError`` that lists them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def output_channels_first(module: nn.Module) -> bool | None:
    """Whether ``module``'s output is channels first, from its type and children; None
    when it passes its input's layout on (elementwise modules and containers of them)."""
    if isinstance(module, CHANNEL_MODULES):
        return True
    if isinstance(module, ELEMENTWISE_MODULES):
        return None
    children = list(module.children())
    if not children:
        return False
    for child in reversed(children):
        found = output_channels_first(child)
        if found is not None:
            return found
    return None


def resolve_channels_first(
    layout: str, lookup: Callable[[str], nn.Module] | None, name: str
) -> bool:
    """Whether the output of the module ``lookup(name)`` is read channels first;
    ``lookup`` maps a dotted name to a module (``PolicyAutoBuilder.get_component``,
    ``nn.Module.get_submodule``). "auto" walks up the dotted name to the module feeding an
    elementwise one; without a ``lookup``, or when nothing decides, it is channels last."""
    if layout != "auto":
        return layout == "channels_first"
    if lookup is None:
        return False
    found = output_channels_first(lookup(name))
    parts = name.split(".") if name else []
    while found is None and parts:
        try:
            parent = lookup(".".join(parts[:-1]))
        except (KeyError, AttributeError):  # above the top of what lookup knows
            break
        siblings = child_modules(parent)
        names = [n for n, _ in siblings]
        if parts[-1] not in names:  # not a registered child: nothing to go by
            break
        for _, sibling in reversed(siblings[: names.index(parts[-1])]):
            if sibling is not None:
                found = output_channels_first(sibling)
                if found is not None:
                    break
        parts = parts[:-1]
    return bool(found)


def as_unit_rows(t: torch.Tensor, channels_first: bool) -> torch.Tensor:
    """``t`` detached, units on the last axis: :func:`as_rows`, or for channels first
    and 3 or more dimensions the view ``(B, *spatial, C)`` (no copy)."""
    if channels_first and t.dim() >= 3:
        return (t.detach() if t.requires_grad else t).movedim(1, -1)
    return as_rows(t)


def positions(t: torch.Tensor, channels_first: bool) -> int:
    """Rows per sample of :func:`as_unit_rows` (the spatial size; 1 for channels last)."""
    if channels_first and t.dim() >= 3 and t.shape[0] and t.shape[1]:
        return t.numel() // (t.shape[0] * t.shape[1])
    return 1
