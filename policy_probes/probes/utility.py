"""Contribution-utility probe: continual backprop's per-unit utility and its low-utility fraction.

Continual backprop (CBP; Dohare et al., "Loss of plasticity in deep continual learning",
Nature 2024) scores every hidden unit i by its *contribution utility*, a running average
of how much the unit passes on to the next layer:

    u_i ← η u_i + (1 − η) |h_i| Σ_k |w_ki|

with h_i the unit's activation and w_ki its outgoing weights (column i of the next
layer's weight). CBP updates it every step; this probe once per report, from the
contribution c_i = mean_rows |h_i| × Σ_k |w_ki| (the window's kept rows, the weights at the
report) folded into the running score with ``decay`` η (the first report starts at c_i).
A unit is *low-utility* when its score is at most ``tau`` of the layer's mean score
(normalised like ReDo's dormancy score).

``low_utility_fraction_ref``: the same criterion on the *instantaneous* contribution on the
run's fixed reference states (:mod:`policy_probes.reference_states`), c_i^ref = mean over
the set of |h_i| × Σ_k |w_ki| with the weights at the report, not folded into the running
score (``reference=False``: not measured).

Layers: every activation layer inside the component whose output the next parametrised
leaf (in registration order; for the last layer the first one of the module ``outgoing``
names) reads: an ``nn.Linear`` or a convolution, with only dropout, ``nn.Identity`` or
``nn.Flatten`` in between. A conv layer's units are its channels (mean |h| over samples and
positions); their outgoing weights are the next convolution's input channels, or the next
``nn.Linear``'s columns of each channel after a channel-major flatten. Anything else in
between (a norm, pooling, a second activation) leaves the layer unscored, refused at attach.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules import conv
from torch.utils.hooks import RemovableHandle

from policy_probes.plugins import Rule, register
from policy_probes.probes.layout import as_unit_rows, positions
from policy_probes.probes.per_layer import activation_layers
from policy_probes.probes.reference_scores import ReferenceScores, UnitValues
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import SUM, Device, Drained, as_floats
from policy_probes.probes.weighted import Weighted
from policy_probes.user_errors import ProbeError

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

UTILITY_EPS = 1e-12
#: layers whose weight holds a unit's outgoing weights
READERS = (nn.Linear, conv._ConvNd)
#: modules that may run between an activation and its reader: each passes every unit's
#: values on as they are (dropout: unchanged in expectation) and keeps the units apart
PASS_THROUGH = (nn.Identity, nn.Flatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)

log = logging.getLogger("policy_probes")


@dataclass(frozen=True)
class Outgoing:
    """The layer reading a scored layer's units: its dotted name and module, whether an
    ``nn.Flatten`` runs in between, and whether the units are channels (axis 1)."""

    name: str
    module: nn.Module
    flattened: bool
    channels_first: bool


def input_magnitude(module: nn.Module) -> torch.Tensor:
    """``sum_k |w_kj|`` for every input column (Linear) or input channel (convolution) j
    of ``module``, in the weight's dtype and device: over the output rows and the kernel."""
    w = module.weight.detach().abs()
    if isinstance(module, nn.Linear):
        return w.sum(0)
    if isinstance(module, conv._ConvTransposeNd):  # (in, out / groups, *kernel)
        return w.flatten(1).sum(1)
    # (out, in / groups, *kernel): group g's outputs read inputs g * in/groups ...
    per = w.flatten(2).sum(2)
    groups = module.groups
    return per.view(groups, -1, per.shape[1]).sum(1).flatten()


def leaves(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """``module``'s leaf modules in registration order, named ``prefix.<path>``."""
    return [
        (f"{prefix}.{n}" if n else prefix, m)
        for n, m in module.named_modules()
        if not any(True for _ in m.children())
    ]


def find_reader(
    layer: str, after: list[tuple[str, nn.Module]]
) -> tuple[str, nn.Module, bool] | str | None:
    """The first Linear or convolution in ``after`` (the leaves that run after ``layer``'s
    activation) and whether an ``nn.Flatten`` runs before it; None when only pass-through
    modules follow (nothing reads the layer where the probe can see it); the refusal, one
    line, when something else runs in between."""
    flattened = False
    for name, module in after:
        if isinstance(module, READERS):
            return name, module, flattened
        if isinstance(module, PASS_THROUGH):
            flattened = flattened or isinstance(module, nn.Flatten)
            continue
        return (
            f"utility probe: {layer} is not scored: {name} ({type(module).__name__}) runs "
            f"between it and the layer that reads it, so no outgoing weights act on its units "
            f"directly. Only dropout, nn.Identity or nn.Flatten may run in between "
            f"(docs/probes/utility.md)"
        )
    return None


def unit_magnitude(
    per_input: torch.Tensor, units: int, out: Outgoing, positions: int
) -> torch.Tensor | str:
    """``sum_k |w_ki|`` per unit i from the reader's per-input sums, or why the widths do
    not fit: a conv layer's channel c owns the reader's input channel c, after a
    channel-major flatten the Linear's columns ``c*P .. (c+1)*P - 1`` (P positions), or
    column c of a Linear reading one value per channel (a global pooling in ``forward``)."""
    inputs = per_input.numel()
    if out.channels_first and isinstance(out.module, nn.Linear):
        if inputs == units * positions:
            return per_input.view(units, positions).sum(1)
        if inputs == units:
            return per_input
        return (
            f"{units} channels x {positions} positions flattened are {units * positions} "
            f"inputs but {out.name} reads {inputs}; the probe reads a conv layer's channels "
            f"and needs the Linear to read them flattened channel-major (x.flatten(1)) or "
            f"one value per channel"
        )
    if inputs == units:
        return per_input
    if out.flattened and inputs % units == 0:  # (B, T, U) flattened: column t * U + i
        return per_input.view(inputs // units, units).sum(0)
    return (
        f"{units} units but {out.name} reads {inputs} inputs; pass outgoing= naming the "
        f"module that reads this layer"
    )


@register
class Utility(ReferenceScores):
    """Per-unit sums of |h| and counts per scored layer (read through hooks of its own);
    each layer's outgoing weights; the running utility per unit (host, float64)."""

    name = "utility"
    maker = "attach_utility_hooks()"
    placements = ("phases", "schedule")
    component_hook = False
    saved_attributes = ("scores",)
    docs = "docs/probes/utility.md"
    metrics = {
        "utility": "per unit: CBP's running contribution utility",
        "low_utility_fraction": "share of units whose utility is at most tau of the layer mean",
        "low_utility_fraction_ref": "share of units whose contribution on the reference "
        "states is at most tau of the layer mean",
    }
    rules = (
        Rule(
            name="low_utility_units",
            title="units stopped contributing on the reference states",
            metric="low_utility_fraction_ref",
            direction="rising",
            kind="level",
            threshold=0.2,
            min_change=0.1,
            threshold_source="policy-probes default, not from a paper; the utility is "
            "continual backprop's (Dohare et al., Nature 2024)",
            docs="docs/probes/utility.md",
            remedies=("continual_backprop", "redo"),
            meaning="more units' contribution |h| * sum|w_out| on the run's fixed reference "
            "states is negligible next to the layer's than a few epochs before",
        ),
    )

    def __init__(
        self,
        *,
        outgoing: str | None = None,
        decay: float = 0.9,
        tau: float = 0.025,
        reference: bool = True,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not tau >= 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        super().__init__(outgoing=outgoing, decay=decay, tau=tau, reference=bool(reference))
        #: layer -> the layer reading its units (whose weight holds their outgoing weights)
        self.outgoing: dict[str, Outgoing] = {}
        #: layer -> running utility per unit
        self.scores: dict[str, torch.Tensor] = {}
        #: component -> its scored layers (reported name, module), found at attach
        self.scored: dict[str, list[tuple[str, nn.Module]]] = {}
        #: conv layer -> positions per sample of its last output
        self.positions: dict[str, int] = {}

    def update(
        self,
        layer: str,
        h: torch.Tensor,
        *,
        channels_first: bool = False,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Add a batch of ``layer``'s activations: units last, or on axis 1 with
        ``channels_first`` (every sample and position a row)."""
        if channels_first and h.dim() >= 3:
            self.positions[layer] = positions(h, channels_first)
        self._push(layer, "h", (as_unit_rows(h, channels_first),), weight=weight)

    def consume(self, batch: Drained) -> None:
        layer, (h,), weight = batch.component, batch.cols, batch.weight
        kept = Weighted(h, weight)
        abs_h = torch.abs(h.clean, out=self.scratch(h.clean))
        self._add(layer, "abs_sum", kept.sums(abs_h))
        self._add(layer, "count", kept.finite_count(), COUNT)

    def reference_sums(self, name: str, values: UnitValues) -> dict[str, torch.Tensor]:
        return {"count": values.count(), "abs_sum": values.abs_sum()}

    def outgoing_magnitude(self, layer: str, units: int, positions: int) -> torch.Tensor | str:
        """``sum_k |w_ki|`` per unit of ``layer`` (host, float64), or why not."""
        out = self.outgoing[layer]
        per_input = input_magnitude(out.module).to(SUM).cpu()
        return unit_magnitude(per_input, units, out, positions)

    def to_metrics(self) -> dict[str, float | list[float]]:
        out = super().to_metrics()
        for layer, s in self.reference_host().items():
            if self.key(layer, "low_utility_fraction") not in out:  # beside the window's
                continue
            count = s["count"]
            out_sum = self.outgoing_magnitude(
                layer, count.numel(), self.reference_positions.get(layer, 1)
            )
            seen = count > 0
            units = int(seen.sum())
            if isinstance(out_sum, str) or not units:
                continue
            contribution = s["abs_sum"] / count.clamp(min=1).to(SUM) * out_sum
            mean = float(contribution[seen].mean())
            low = contribution / (mean + UTILITY_EPS) <= self.settings[layer]["tau"]
            out[self.key(layer, "low_utility_fraction_ref")] = float((low & seen).sum()) / units
        return out

    def summarize(self, layer: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        out = self.outgoing.get(layer)
        if out is None or "count" not in s:
            return {}
        count = s["count"]
        out_sum = self.outgoing_magnitude(layer, count.numel(), self.positions.get(layer, 1))
        if isinstance(out_sum, str):  # reported like a lost window, training goes on
            self.errors[layer] = out_sum
            return {}
        seen = count > 0
        mean_abs = s["abs_sum"] / count.clamp(min=1).to(SUM)
        contribution = mean_abs * out_sum
        prev = self.scores.get(layer)
        decay = cfg["decay"]
        score = (
            contribution
            if prev is None or prev.shape != contribution.shape
            else decay * prev + (1 - decay) * contribution
        )
        self.scores[layer] = score
        units = int(seen.sum())
        if not units:
            return {}
        mean = float(score[seen].mean())
        low = score / (mean + UTILITY_EPS) <= cfg["tau"]
        return {
            "utility": as_floats(score),
            "utility_mean": mean,
            "contribution_mean": float(contribution[seen].mean()),
            "low_utility_fraction": float((low & seen).sum()) / units,
        }

    def state_dict(self) -> dict[str, Any]:
        """The window and running scores, and each conv layer's positions per sample (a
        window resumed from a checkpoint can be reported before another forward)."""
        return {**super().state_dict(), "positions": dict(self.positions)}

    def load_state_dict(self, state: dict[str, Any], device: Device = None) -> None:
        super().load_state_dict(state, device)
        self.positions = {k: int(v) for k, v in (state.get("positions") or {}).items()}

    def plain_call_gaps(self, obs: Observation, module: nn.Module) -> str:
        return "the activation layers inside it, read through hooks of their own"

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        if obs.component not in self.scored:
            self.scored[obs.component] = self._scored_layers(obs, module)
        handles = []
        for name, sub in self.scored[obs.component]:
            cf = self.outgoing[name].channels_first

            def record(h: torch.Tensor, weight: Any, name: str = name, cf: bool = cf) -> None:
                self.update(name, h, channels_first=cf, weight=weight)

            handles.append(obs.inner_hook(name, sub, record, cf))
            self.read_reference(name, obs, sub, cf)
        return handles

    def _scored_layers(self, obs: Observation, module: nn.Module) -> list[tuple[str, nn.Module]]:
        settings = self.settings[obs.component]
        tail: list[tuple[str, nn.Module]] = []
        if settings["outgoing"] is not None:
            if obs.locate is None:
                raise ProbeError(
                    f"utility probe on {obs.component!r}: outgoing={settings['outgoing']!r} "
                    f"needs the policy to look it up; attach through PolicyAutoBuilder.attach"
                )
            tail = leaves(obs.locate(settings["outgoing"]), settings["outgoing"])
        inside = leaves(module, obs.component)
        index = {id(m): i for i, (_, m) in enumerate(inside)}
        out = []
        for layer in activation_layers(module):
            name = f"{obs.component}.{layer.name}"
            at = index.get(id(layer.act))
            found = None if at is None else find_reader(name, inside[at + 1 :] + tail)
            if found is None:
                continue  # nothing reads it inside the component and no outgoing= given
            if isinstance(found, str):  # refused once, here; the other layers are scored
                if obs.context.strict:
                    raise ProbeError(found)
                obs.context.probe_errors[f"{self.name}/{name}"] = found
                log.error("%s", found)
                continue
            reader, reader_module, flattened = found
            channels_first = obs.resolve_layout(module, layer.name)
            if self.register_component(name, **settings):
                self.outgoing[name] = Outgoing(reader, reader_module, flattened, channels_first)
                out.append((name, layer.module))
        return out


def attach_utility_hooks(
    *,
    outgoing: str | None = None,
    decay: float = 0.9,
    tau: float = 0.025,
    reference: bool = True,
) -> Utility:
    """The ``utility`` probe (:class:`Utility`, docs/probes/utility.md): CBP's contribution
    utility and the low-utility fraction (at most ``tau`` of the layer mean). ``outgoing``
    names the module reading the component's output (``"actor_head"``) so its last layer
    is scored too; ``decay``: η, once per report; ``reference``: also report
    ``low_utility_fraction_ref`` on the run's reference states (docs/reference_states.md).
    Placed with ``phases`` and ``schedule``."""
    return Utility(outgoing=outgoing, decay=decay, tau=tau, reference=reference)
