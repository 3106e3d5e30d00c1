"""Per-layer figures: one line per layer of a component over epochs, so "which layer is
dying" is one look (probes attached with ``per_layer=True`` report
``probes/<probe>/<component>.<layer>/<metric>``). One figure per probe section and
component, embedded by the report and logged by sinks as ``layers/<section>/<component>``."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from policy_probes.analysis.heatmaps import fixed_margins
from policy_probes.records import RunRecords

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class Panel(NamedTuple):
    """One panel of a probe section: ``probes/<probe>/<component>/<metric>`` over epochs."""

    probe: str
    metric: str
    title: str
    #: a log-scale y axis (values spread over decades)
    log: bool = False
    #: also drawn per layer (the activation and gradient metrics; Fisher is per parameter)
    per_layer: bool = False


def _per_layer(probe: str, metric: str, title: str, log: bool = False) -> Panel:
    return Panel(probe, metric, title, log, per_layer=True)


#: the report's probe sections: (slug, title, panels)
PROBE_SECTIONS: tuple[tuple[str, str, tuple[Panel, ...]], ...] = (
    (
        "relu",
        "Dead and dormant ReLU units",
        (
            _per_layer("relu", "dead_fraction", "dead fraction (active rate 0)"),
            _per_layer("relu", "dormant_fraction", "dormant fraction (ReDo, tau)"),
            Panel("relu", "rarely_active_fraction", "rarely active fraction (< 5%)"),
            Panel("relu", "zero_fraction", "zero fraction (elements <= 0)"),
        ),
    ),
    (
        "saturation",
        "Saturated activations",
        (
            Panel("saturation_tanh", "saturated_fraction", "tanh: saturated elements"),
            _per_layer("saturation_tanh", "saturated_units_fraction", "tanh: saturated units"),
            Panel("saturation_sigmoid", "saturated_fraction", "sigmoid: saturated elements"),
            _per_layer(
                "saturation_sigmoid", "saturated_units_fraction", "sigmoid: saturated units"
            ),
        ),
    ),
    (
        "fisher",
        "Fisher information",
        (
            Panel("fisher", "trace", "Fisher trace", log=True),
            Panel("fisher", "max", "Fisher max (per parameter)", log=True),
            Panel("fisher", "dead_param_fraction", "dead parameter fraction (Fisher < 1e-8)"),
        ),
    ),
    (
        "gradients",
        "Gradient flow",
        (
            _per_layer("gradient_flow", "mean", "gradient RMS, mean over units", log=True),
            _per_layer("gradient_flow", "blocked_fraction", "blocked units (gradient RMS < 1e-8)"),
            _per_layer(
                "relu_gradient_flow", "blocked_fraction", "units no gradient passed through (ReLU)"
            ),
        ),
    ),
)

#: ``(probe, metric)`` of the panels drawn per layer
LAYER_PANELS = frozenset(
    (panel.probe, panel.metric)
    for _, _, panels in PROBE_SECTIONS
    for panel in panels
    if panel.per_layer
)

#: (section slug, section title, panels) of the sections with per-layer panels
LAYER_SECTIONS = tuple(
    (slug, title, layer_panels)
    for slug, title, panels in PROBE_SECTIONS
    if (layer_panels := tuple(p for p in panels if p.per_layer))
)


Series = Sequence[tuple[int, float]]


def is_layer_metric(key: str) -> bool:
    """Whether ``probes/<probe>/<name>/<metric>`` is a metric the per-layer figures draw."""
    parts = key.split("/")
    return len(parts) == 4 and parts[0] == "probes" and (parts[1], parts[3]) in LAYER_PANELS


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def layer_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """``component -> [its layers]`` (natural order) among ``names``: a name is a layer of
    the longest other name that is a dotted prefix of it (``actor_mlp.layer_0``)."""
    names = set(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:cut])
            if parent in names:
                groups.setdefault(parent, []).append(name)
                break
    return {c: sorted(layers, key=_natural) for c, layers in sorted(groups.items())}


def layer_figures(records: RunRecords) -> list[tuple[str, str, Figure]]:
    """``(section slug, component, figure)`` of every section and component with layers."""
    series = {k: records.series(k) for k in records.scalars if is_layer_metric(k)}
    keys = [key.split("/") for key in series]  # probes/<probe>/<name>/<metric>
    out = []
    for slug, _title, panels in LAYER_SECTIONS:
        wanted = {(p.probe, p.metric) for p in panels}
        names = {name for _, probe, name, metric in keys if (probe, metric) in wanted}
        for component, layers in layer_groups(names).items():
            present = [
                p
                for p in panels
                if any(f"probes/{p.probe}/{layer}/{p.metric}" in series for layer in layers)
            ]
            if present:
                out.append((slug, component, _figure(series, component, layers, present)))
    return out


def _figure(
    series: Mapping[str, Series],
    component: str,
    layers: list[str],
    panels: list[Panel],
) -> Figure:
    fig, axes = panel_grid(len(panels), height=3.0)
    for ax, (probe, metric, title, log, _) in zip(axes, panels, strict=True):
        for layer in layers:
            points = series.get(f"probes/{probe}/{layer}/{metric}")
            if points:
                plot_series(ax, points, label=layer[len(component) + 1 :], log=log)
        if not log and metric.endswith("fraction"):
            ax.set_ylim(-0.03, 1.03)
        style_axes(ax, f"{title}: {component}", log=log)
        ax.legend(fontsize=8, title="layer", title_fontsize=8)
    return fig


def panel_grid(
    n: int, cols: int = 2, height: float = 2.8, width: float = 5.2
) -> tuple[Figure, list[Any]]:
    """A figure of ``n`` panels, ``cols`` to a row (the report's and these figures')."""
    from matplotlib.figure import Figure

    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=100)
    fixed_margins(fig, rows, cols, top=0.55, hgap=1.0)
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(n)]


def style_axes(ax: Any, title: str, log: bool = False, ylabel: str | None = None) -> None:
    """Title, epoch axis, grid and tick sizes of a panel over epochs."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("epoch", fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.locator_params(axis="x", integer=True)
    if log:
        ax.set_yscale("log")


def plot_series(
    ax: Any, points: Series, label: str | None = None, log: bool = False, **style: Any
) -> Any:
    """One line of ``(epoch, value)`` points (markers on short series; values <= 0 left
    out on a log axis)."""
    x, y = np.array([e for e, _ in points]), np.array([v for _, v in points], dtype=float)
    if log:
        y = np.where(y > 0, y, np.nan)
    marker = "o" if len(x) <= 30 else None
    (line,) = ax.plot(x, y, marker=marker, markersize=3, linewidth=1.5, label=label, **style)
    return line
