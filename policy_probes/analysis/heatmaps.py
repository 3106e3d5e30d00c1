"""Units x epochs heatmaps of per-unit probe vectors (active rate, Fisher, gradient RMS): a
row per unit, a column per epoch, so one sees which units died and when. Drawn without
pyplot (no global matplotlib state) for the report and the sinks that log images."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from policy_probes.records import RunRecords

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn (a session may never)
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class HeatmapSpec:
    """How to draw the heatmap of one per-unit metric."""

    probe: str
    metric: str
    title: str
    colorbar: str
    log: bool = False
    #: draw exact zeros (e.g. dead units: active rate 0) in this colour
    zero_color: str | None = None


#: per-unit vectors that get a units x epochs heatmap, keyed by (probe, metric)
HEATMAP_SPECS: dict[tuple[str, str], HeatmapSpec] = {
    ("relu", "active_rate"): HeatmapSpec(
        "relu", "active_rate", "ReLU active rate", "fraction of samples > 0", zero_color="red"
    ),
    ("fisher", "unit"): HeatmapSpec(
        "fisher", "unit", "Fisher information per unit", "diagonal Fisher (log)", log=True
    ),
    ("gradient_flow", "rms"): HeatmapSpec(
        "gradient_flow", "rms", "Gradient RMS per unit", "gradient RMS (log)", log=True
    ),
}


def heatmap_spec(key: str) -> HeatmapSpec | None:
    """The spec for a metric key ``probes/<probe>/<component>/<metric>``, else None."""
    parts = key.split("/")
    if len(parts) < 4 or parts[0] != "probes":
        return None
    return HEATMAP_SPECS.get((parts[1], parts[-1]))


def component_of(key: str) -> str:
    """``probes/<probe>/<component>/<metric>`` -> ``<component>`` (may contain dots)."""
    return "/".join(key.split("/")[2:-1])


def units_by_epochs(
    rows: Iterable[tuple[int, Sequence[float | None]]],
) -> tuple[np.ndarray, list[int]]:
    """``(epoch, vector)`` rows as a ``units x epochs`` array (NaN where missing) and epochs."""
    rows = list(rows)
    epochs = [int(e) for e, _ in rows]
    units = max((len(v) for _, v in rows), default=0)
    out = np.full((units, len(rows)), np.nan, dtype=np.float64)
    for j, (_, vec) in enumerate(rows):
        col = np.array([np.nan if v is None else float(v) for v in vec], dtype=np.float64)
        out[: len(col), j] = col
    out[~np.isfinite(out)] = np.nan
    return out, epochs


def heatmap_figure(
    matrix: np.ndarray,
    epochs: Sequence[int],
    spec: HeatmapSpec,
    component: str,
    *,
    figsize: tuple[float, float] = (7.0, 3.6),
) -> Figure:
    """A matplotlib Figure (no pyplot state) of one units x epochs heatmap."""
    return _Canvas(matrix, epochs, spec, component, figsize).figure


def _colours(matrix: np.ndarray, spec: HeatmapSpec) -> tuple[np.ndarray, Any, Normalize]:
    import matplotlib
    from matplotlib.colors import LogNorm, Normalize

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    data = np.ma.masked_invalid(matrix)
    if spec.log:
        positive = matrix[np.isfinite(matrix) & (matrix > 0)]
        vmax = float(positive.max()) if positive.size else 1.0
        vmin = max(float(positive.min()), vmax * 1e-8) if positive.size else 1e-12
        if vmin >= vmax:
            vmin = vmax / 10
        cmap = cmap.with_extremes(under="black")
        data = np.ma.masked_invalid(np.where(matrix > 0, matrix, vmin * 0.5))
        norm: Normalize = LogNorm(vmin=vmin, vmax=vmax, clip=False)
    elif spec.zero_color is not None:
        cmap = cmap.with_extremes(under=spec.zero_color)
        norm = Normalize(vmin=1e-12, vmax=1.0)
    else:
        norm = Normalize(vmin=0.0, vmax=1.0)
    return data, cmap, norm


def _title(matrix: np.ndarray, epochs: Sequence[int], spec: HeatmapSpec, component: str) -> str:
    units, n = matrix.shape
    title = f"{spec.title}: {component}"
    if spec.zero_color is not None and n:
        dead_now = int(np.sum(matrix[:, -1] == 0))
        title += f"  ({dead_now}/{units} units at 0 in epoch {epochs[-1]}, shown {spec.zero_color})"
    return title


class _Canvas:
    """One heatmap figure, redrawn for every matrix of the same metric, shape and epochs
    (building a figure is half of what drawing one costs; the sinks draw a dozen alike)."""

    def __init__(
        self,
        matrix: np.ndarray,
        epochs: Sequence[int],
        spec: HeatmapSpec,
        component: str,
        figsize: tuple[float, float] = (7.0, 3.6),
    ) -> None:
        from matplotlib.figure import Figure

        self.spec = spec
        self.epochs = list(epochs)
        self.figure = Figure(figsize=figsize, dpi=100)
        fixed_margins(self.figure)
        ax = self.figure.add_subplot()
        data, cmap, norm = _colours(matrix, spec)
        first, last = (epochs[0], epochs[-1]) if len(epochs) else (0, 0)
        extent = (first - 0.5, last + 0.5, matrix.shape[0] - 0.5, -0.5)
        self.image = ax.imshow(
            data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, extent=extent
        )
        extend = "min" if (spec.log or spec.zero_color) else "neither"
        self.colorbar = self.figure.colorbar(self.image, ax=ax, extend=extend)
        self.colorbar.set_label(spec.colorbar)
        self.title = ax.set_title(_title(matrix, epochs, spec, component), fontsize=10)
        ax.set_xlabel("epoch")
        ax.set_ylabel("unit")
        ax.locator_params(axis="x", integer=True)
        ax.locator_params(axis="y", integer=True)
        self.fresh = True

    def png(self, matrix: np.ndarray, component: str) -> bytes:
        """PNG bytes of ``matrix`` (of the shape and epochs the canvas was made for)."""
        if not self.fresh:
            data, cmap, norm = _colours(matrix, self.spec)
            self.image.set_data(data)
            self.image.set_cmap(cmap)
            self.image.set_norm(norm)
            self.colorbar.update_normal(self.image)
            self.title.set_text(_title(matrix, self.epochs, self.spec, component))
        self.fresh = False
        return figure_png(self.figure)


def fixed_margins(
    fig: Figure, rows: int = 1, cols: int = 1, *, top: float = 0.45, hgap: float = 0.85
) -> None:
    """Margins and gaps in inches (left 0.75, right 0.15, bottom 0.55, between columns
    0.75; matplotlib's layout engines cost ~0.5 s a figure). Call before adding axes."""
    left, right, bottom, wgap = 0.75, 0.15, 0.55, 0.75
    w, h = fig.get_size_inches()
    axes_h = (h - top - bottom - hgap * (rows - 1)) / rows
    axes_w = (w - left - right - wgap * (cols - 1)) / cols
    fig.subplots_adjust(
        left=left / w,
        right=1 - right / w,
        top=1 - top / h,
        bottom=bottom / h,
        hspace=hgap / max(axes_h, 1e-3),
        wspace=wgap / max(axes_w, 1e-3),
    )


def heatmap_matrices(
    records: RunRecords, max_epochs: int | None = None
) -> Iterator[tuple[str, HeatmapSpec, np.ndarray, list[int]]]:
    """``(key, spec, units x epochs matrix, epochs)`` of every per-unit key of ``records``
    with a heatmap and any values (of its last ``max_epochs`` epochs; None: all)."""
    for key, vectors in records.vectors.items():
        spec = heatmap_spec(key)
        if spec is not None:
            rows = sorted(vectors.items())
            matrix, epochs = units_by_epochs(rows if max_epochs is None else rows[-max_epochs:])
            if matrix.size:
                yield key, spec, matrix, epochs


def render_heatmaps(records: RunRecords) -> dict[str, tuple[bytes, str]]:
    """``heatmaps/<probe>/<component>/<metric>`` -> (PNG, caption) of every per-unit key of
    ``records`` with a heatmap; equal histories (a component and its last layer) share
    one drawing titled with both names."""
    drawn: dict[tuple[Any, ...], tuple[list[str], np.ndarray, list[int], HeatmapSpec]] = {}
    for key, spec, matrix, epochs in heatmap_matrices(records):
        # one NaN for every missing or non-finite value: equal histories have equal bytes
        same = (spec, matrix.shape, tuple(epochs), matrix.tobytes())
        drawn.setdefault(same, ([], matrix, epochs, spec))[0].append(key)
    canvases: dict[tuple[Any, ...], _Canvas] = {}
    out: dict[str, tuple[bytes, str]] = {}
    for keys, matrix, epochs, spec in drawn.values():
        names = " = ".join(component_of(k) for k in keys)
        layout = (spec, matrix.shape, tuple(epochs))
        canvas = canvases.get(layout)
        if canvas is None:
            canvas = canvases[layout] = _Canvas(matrix, epochs, spec, names)
        png = canvas.png(matrix, names)
        for key in keys:
            caption = f"{spec.title}, {component_of(key)}, epochs {epochs[0]}-{epochs[-1]}"
            out["heatmaps/" + key.removeprefix("probes/")] = (png, caption)
    return out


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a Figure."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
