"""Building blocks and component specs for policies made of named parts: an MLP names its
hidden layers ``layer_<i>`` with children ``linear`` and ``act`` (``actor_mlp.layer_0.linear``:
the first layer's pre-activation).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from torch import nn

from policy_probes.user_errors import mark_usage_error

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "gelu": nn.GELU,
    "elu": nn.ELU,
    "silu": nn.SiLU,
    "leaky_relu": nn.LeakyReLU,
    "identity": nn.Identity,
}


def make_activation(name: str) -> nn.Module:
    """Return a fresh activation module by name; unknown names list the supported ones."""
    try:
        return ACTIVATIONS[name]()
    except KeyError:
        close = difflib.get_close_matches(name, ACTIVATIONS, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unsupported activation {name!r}; choose one of {sorted(ACTIVATIONS)}.{hint}"
        ) from None


class HiddenLayer(nn.Module):
    """``act(linear(x))`` with both parts addressable by name; with ``layer_norm=True``
    ``act(norm(linear(x)))``, ``norm`` an ``nn.LayerNorm`` over the layer's features."""

    def __init__(
        self, in_features: int, out_features: int, activation: str, layer_norm: bool = False
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.norm = nn.LayerNorm(out_features) if layer_norm else None
        self.act = make_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.act(x)


class ConvLayer(nn.Module):
    """``act(conv(x))``, an unpadded 2-d convolution; with ``layer_norm=True``
    ``act(norm(conv(x)))``, ``norm`` a ``nn.GroupNorm(1, C)`` (per sample: channels, positions)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        activation: str,
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride)
        self.norm = nn.GroupNorm(1, out_channels) if layer_norm else None
        self.act = make_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.act(x)


#: blocks ``act(layer(x))`` whose output is their ``.act``'s: one activation layer each
LAYER_BLOCKS = (HiddenLayer, ConvLayer)


class MLP(nn.Module):
    """Stack of :class:`HiddenLayer` blocks named ``layer_0``, ``layer_1``, ...; its output
    is the last block's activation, so a probe on the whole MLP sees activations."""

    def __init__(
        self,
        in_features: int,
        hidden_sizes: Sequence[int],
        activation: str,
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        if not hidden_sizes:
            raise ValueError("an MLP needs at least one hidden layer (hidden_sizes is empty)")
        if any(int(h) <= 0 for h in hidden_sizes):
            raise ValueError(f"hidden sizes must be positive, got {list(hidden_sizes)}")
        make_activation(activation)  # validate the name before building anything
        sizes = [in_features, *hidden_sizes]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            self.add_module(f"layer_{i}", HiddenLayer(a, int(b), activation, layer_norm))
        self.out_features = int(sizes[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


class MLPSpec(BaseModel):
    """A component that is an :class:`MLP`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    kind: Literal["mlp"] = "mlp"
    in_features: int = Field(gt=0)
    hidden_sizes: list[int] = Field(min_length=1)
    activation: str = "relu"
    layer_norm: bool = False

    def build(self) -> nn.Module:
        return MLP(self.in_features, self.hidden_sizes, self.activation, self.layer_norm)

    def parameter_count(self) -> int:
        """The parameters :meth:`build` allocates, from the sizes (nothing is built):
        weight and bias of each linear layer, and each LayerNorm's weight and bias."""
        sizes = [self.in_features, *self.hidden_sizes]
        linear = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        return linear + (2 * sum(self.hidden_sizes) if self.layer_norm else 0)


class LinearSpec(BaseModel):
    """A component that is one ``nn.Linear`` (a policy or value head)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    kind: Literal["linear"] = "linear"
    in_features: int = Field(gt=0)
    out_features: int = Field(gt=0)

    def build(self) -> nn.Module:
        return nn.Linear(self.in_features, self.out_features)

    def parameter_count(self) -> int:
        """The parameters :meth:`build` allocates: weight and bias."""
        return self.in_features * self.out_features + self.out_features


ComponentSpec = Annotated[MLPSpec | LinearSpec, Field(discriminator="kind")]


def physical_memory() -> int | None:
    """Bytes of this machine's memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _bytes(n: float) -> str:
    """``n`` bytes in binary units."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.1f} {units[i]}"


def check_spec_memory(spec: Mapping[str, object]) -> None:
    """Refuse component specs whose parameters alone do not fit in this machine's memory,
    counted from their sizes before anything is allocated (``hidden_sizes=[10**8, 10**8]``
    would otherwise ask torch for petabytes); a usage error stating the size."""
    counts = {}
    for name, part in spec.items():
        if isinstance(part, dict):
            try:
                part = TypeAdapter(ComponentSpec).validate_python(part)
            except ValueError:
                continue  # build_component says what is wrong with it
        if isinstance(part, MLPSpec | LinearSpec):
            counts[name] = part.parameter_count()
    memory = physical_memory()
    dtype = torch.get_default_dtype()
    total = sum(counts.values())
    if memory is None or total * dtype.itemsize <= memory:
        return
    largest = max(counts, key=counts.__getitem__)
    part = spec[largest]
    sizes = (
        part.get("hidden_sizes") if isinstance(part, dict) else getattr(part, "hidden_sizes", None)
    )
    what = f"{largest!r} (hidden_sizes={sizes})" if sizes else repr(largest)
    raise mark_usage_error(
        ValueError(
            f"the policy's components would hold {total:,} parameters, "
            f"{_bytes(total * dtype.itemsize)} as {str(dtype).removeprefix('torch.')}, more "
            f"than this machine's {_bytes(memory)} of memory ({what} alone: "
            f"{counts[largest]:,}); make the layers smaller"
        )
    )


def build_component(name: str, part: object) -> nn.Module:
    """An ``nn.Module``, a spec object, or a spec as a dict (``{"kind": "mlp", ...}``)."""
    if isinstance(part, nn.Module):
        return part
    if isinstance(part, MLPSpec | LinearSpec):
        return part.build()
    if isinstance(part, dict):
        return TypeAdapter(ComponentSpec).validate_python(part).build()
    raise TypeError(
        f"component {name!r} must be an nn.Module, an MLPSpec/LinearSpec or a dict with "
        f"kind='mlp'|'linear', got {type(part).__name__}"
    )
