"""Where a component's units are: the layers that produce them (*unit layers*: a Linear or
convolution followed by an activation, or a recurrent layer giving the output) and their
*consumers* (the next parametrised layer, or the components named as the last one's
consumers), found from the component's leaves in registration order. Only elementwise
modules, pooling and ``nn.Flatten`` may run in between, so a unit's outgoing weights are
its consumer's input columns (after a channel-major flatten of ``(B, C, H, W)``, columns
``u*H*W ... (u+1)*H*W - 1``); ``docs/remedies.md`` has the details."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.modules import conv, pooling

from policy_probes.layers import LAYER_BLOCKS
from policy_probes.probes.layout import ACTIVATION_MODULES, ELEMENTWISE_MODULES
from policy_probes.probes.per_layer import activation_layers
from policy_probes.remedies.base import name_list

#: layers whose units the remedies can recycle one by one
RECURRENT = (nn.LSTM, nn.GRU)
#: modules that keep every unit's values apart between a layer and its consumer
PASS_THROUGH = (
    *ELEMENTWISE_MODULES,
    nn.Flatten,
    pooling._MaxPoolNd,
    pooling._AvgPoolNd,
    pooling._AdaptiveAvgPoolNd,
    pooling._AdaptiveMaxPoolNd,
)
#: gate blocks of the recurrent layers (rows of weight_ih/weight_hh and the biases)
GATES = {nn.LSTM: 4, nn.GRU: 3}


@dataclass(frozen=True)
class Consumer:
    """A layer reading a unit layer's output: ``block`` input columns per unit."""

    name: str
    module: nn.Module
    block: int

    @property
    def weight_name(self) -> str:
        """The consumer's parameter whose columns are the units' outgoing weights."""
        return "weight_ih_l0" if isinstance(self.module, RECURRENT) else "weight"


@dataclass(frozen=True)
class UnitLayer:
    """A layer whose units ReDo can recycle."""

    #: the name its ReLU-probe scores are reported under (``critic_mlp.layer_0``)
    name: str
    #: other names those scores may be under (the component itself for its last layer)
    aliases: tuple[str, ...]
    producer: nn.Module
    producer_name: str
    units: int
    consumers: tuple[Consumer, ...]
    #: the activation module that follows the producer (None for a recurrent layer)
    activation: nn.Module | None = None

    @property
    def gates(self) -> int:
        """Row blocks per unit in the producer's parameters (1, or 4/3 for LSTM/GRU)."""
        return GATES.get(type(self.producer), 1)


def leaves(component: nn.Module) -> list[tuple[str, nn.Module]]:
    """The component's leaf modules in registration order (else the component itself)."""
    out = [(n, m) for n, m in component.named_modules() if not any(True for _ in m.children())]
    return out or [("", component)]


def has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def unit_count(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, conv._ConvNd):
        return module.out_channels
    return module.hidden_size


def layer_units(module: nn.Module) -> int:
    """Output units of a layer (its first parameter's rows for unknown kinds)."""
    try:
        return unit_count(module)
    except AttributeError:
        first = next(module.parameters(recurse=False))
        return int(first.shape[0]) if first.dim() else 1


def check_producer(name: str, module: nn.Module, where: str) -> None:
    """Refuse layers whose units are not rows of their parameters."""
    if isinstance(module, conv._ConvTransposeNd):
        raise ValueError(
            f"{where}: {name!r} is a transposed convolution; ReDo recycles "
            f"nn.Linear, nn.Conv1d/2d/3d, nn.LSTM and nn.GRU units"
        )
    if isinstance(module, RECURRENT) and (
        module.num_layers != 1 or module.bidirectional or getattr(module, "proj_size", 0)
    ):
        raise ValueError(
            f"{where}: {name!r} is a {type(module).__name__} with num_layers="
            f"{module.num_layers}, bidirectional={module.bidirectional}; ReDo recycles the "
            f"units of single-layer, unidirectional recurrent layers without projection "
            f"(stack nn.{type(module).__name__} modules of one layer each)"
        )


def as_consumer(name: str, module: nn.Module, producer: nn.Module, where: str) -> Consumer:
    """``module`` as the consumer of ``producer``'s units, with the columns per unit."""
    units = unit_count(producer)
    if isinstance(module, nn.Linear):
        width = module.in_features
    elif isinstance(module, conv._ConvNd) and not isinstance(module, conv._ConvTransposeNd):
        if module.groups != 1:
            raise ValueError(
                f"{where}: consumer {name!r} is a grouped convolution "
                f"(groups={module.groups}); ReDo needs groups=1"
            )
        width = module.in_channels
    elif isinstance(module, RECURRENT):
        check_producer(name, module, where)
        width = module.input_size
    else:
        raise ValueError(
            f"{where}: {name!r} ({type(module).__name__}) reads the units next, and ReDo can "
            f"zero outgoing weights only in nn.Linear, nn.Conv1d/2d/3d, nn.LSTM or nn.GRU "
            f"consumers (a normalisation mixes the units); use reset_layers or "
            f"shrink_and_perturb on this component"
        )
    flattened = isinstance(producer, conv._ConvNd) and isinstance(module, nn.Linear)
    if width == units:
        return Consumer(name, module, 1)
    if flattened and width % units == 0:
        return Consumer(name, module, width // units)  # channel-major flattened positions
    raise ValueError(
        f"{where}: consumer {name!r} reads {width} inputs, which do not match the {units} "
        f"units of {type(producer).__name__} (nor {units} channels flattened); name the "
        f"module that reads them with consumer=..."
    )


def first_consumer(name: str, module: nn.Module, producer: nn.Module, where: str) -> Consumer:
    """The first parametrised leaf of ``module``, reached through pass-through modules only."""
    for sub, leaf in leaves(module):
        full = f"{name}.{sub}" if sub else name
        if has_parameters(leaf):
            return as_consumer(full, leaf, producer, where)
        if not isinstance(leaf, PASS_THROUGH):
            break
    raise ValueError(
        f"{where}: {name!r} does not start with a parametrised layer reached through "
        f"elementwise, pooling or flatten modules only, so the units' outgoing weights "
        f"cannot be found in it"
    )


def chosen_leaves(
    remedy: str, target: Any, layers: Sequence[str] | None
) -> list[tuple[str, nn.Module]]:
    """The target's parametrised leaves, or those ``layers`` (names inside it) name."""
    found = parametrised_leaves(target.component, target.module)
    if layers is None:
        return found
    by_name = dict(found)
    out = []
    for layer in layers:
        full = f"{target.component}.{layer}" if layer else target.component
        if full not in by_name:
            raise ValueError(
                f"{remedy} on {target.component!r}: no parametrised layer {layer!r}; choose "
                f"from {[n for n, _ in found]} (names inside the component, without "
                f"{target.component + '.'!r})"
            )
        out.append((full, by_name[full]))
    return out


def target_unit_layers(
    target: Any, consumer: Sequence[str] | None, remedy: str = "ReDo"
) -> list[UnitLayer]:
    """:func:`unit_layers` of a target (consumers: ``consumer``, else the policy's)."""
    names = consumer
    if names is None:
        consumers = getattr(target.policy, "component_consumers", None) or {}
        names = name_list(consumers.get(target.component, ()))
    external = [(n, target.policy.get_component(n)) for n in names]
    return unit_layers(target.component, target.module, external, remedy=remedy)


def unit_layers(
    component_name: str,
    component: nn.Module,
    external: Sequence[tuple[str, nn.Module]],
    remedy: str = "ReDo",
) -> list[UnitLayer]:
    """The unit layers of ``component`` in order; ``external``: (name, module) of the
    consumers of its output. A ``ValueError`` for structures whose units cannot be recycled
    without changing the outputs (a normalisation before a consumer, no named consumer)."""
    where = f"{remedy} on {component_name!r}"
    names: dict[int, str] = {id(a.act): a.name for a in activation_layers(component)}
    if isinstance(component, LAYER_BLOCKS):
        names[id(component.act)] = ""
    items = leaves(component)
    out: list[UnitLayer] = []
    params = [i for i, (_, m) in enumerate(items) if has_parameters(m)]
    for k, i in enumerate(params):
        pname, producer = items[i]
        end = params[k + 1] if k + 1 < len(params) else len(items)
        between = items[i + 1 : end]
        acts = [m for _, m in between if isinstance(m, ACTIVATION_MODULES)]
        last = k + 1 == len(params)
        recurrent_out = isinstance(producer, RECURRENT) and last and not between
        if not (isinstance(producer, nn.Linear | conv._ConvNd) and acts) and not recurrent_out:
            continue  # no activation after it: not scored (an output layer)
        check_producer(pname, producer, where)
        for n, m in between:
            if not isinstance(m, PASS_THROUGH):
                raise ValueError(
                    f"{where}: {n!r} ({type(m).__name__}) runs between {pname!r} and the layer "
                    f"that reads its units; it mixes or changes units, so zeroing their "
                    f"outgoing weights would not keep the outputs. Use reset_layers or "
                    f"shrink_and_perturb on this component"
                )
        layer = names.get(id(acts[-1])) if acts else None  # a recurrent output: no activation
        key = f"{component_name}.{layer}" if layer else component_name
        aliases = (component_name,) if last and key != component_name else ()
        if not last:
            cname, cmod = items[end]
            consumers = (as_consumer(f"{component_name}.{cname}", cmod, producer, where),)
        elif external:
            consumers = tuple(first_consumer(n, m, producer, where) for n, m in external)
        else:
            raise ValueError(
                f"{where}: the output of its last layer {pname or component_name!r} leaves the "
                f"component, and no consumer is named; pass consumer='<component>' (the module "
                f"that reads it, e.g. consumer='critic_head'), or give the policy a "
                f"component_consumers mapping"
            )
        full = f"{component_name}.{pname}" if pname else component_name
        activation = acts[0] if acts else None
        out.append(
            UnitLayer(key, aliases, producer, full, unit_count(producer), consumers, activation)
        )
    if not out:
        raise ValueError(
            f"{where}: no layer in it is followed by an activation (nor is it a recurrent "
            f"layer), so it has no units with dormant scores to recycle"
        )
    return out


def parametrised_leaves(component_name: str, component: nn.Module) -> list[tuple[str, nn.Module]]:
    """The leaves of ``component`` that own parameters: (dotted name in the policy, module)."""
    return [
        (f"{component_name}.{n}" if n else component_name, m)
        for n, m in leaves(component)
        if has_parameters(m)
    ]
