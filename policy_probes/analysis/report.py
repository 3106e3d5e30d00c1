"""The local dashboard: ``policy-probes report RUN_DIR`` -> ``RUN_DIR/report.html``.

One self-contained HTML file (matplotlib PNGs inlined) built from ``metrics.jsonl`` (and
``config.json``), so it works for any run, finished or still going: the findings, returns,
losses, probe sections per component and per layer, heatmaps and every scalar's range. A
fork's parent (dashed) and the ``--compare`` runs are overlaid in each line's colour."""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_probes.analysis.findings import cli_error, judge, run_rules
from policy_probes.analysis.findings import render_html as render_findings_html
from policy_probes.atomic_write import write_text_atomic
from policy_probes.records import METRICS_JSONL, RunRecords
from policy_probes.user_errors import positive_int

# the figures' modules (numpy, matplotlib) are imported where a figure is drawn, so that
# `policy-probes --help` does not wait for them
if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from policy_probes.analysis.layer_figures import Panel

REPORT_HTML = "report.html"

RETURN_KEYS = (
    ("rollout/episode_return", "training episodes"),
    ("eval/return_mean", "evaluation (deterministic)"),
)
TRAIN_KEYS = (
    ("train/policy_loss", "policy loss", False),
    ("train/value_loss", "value loss", True),
    ("train/entropy", "entropy", False),
    ("train/approx_kl", "approx KL", True),
    ("train/clipfrac", "clip fraction", False),
    ("train/explained_variance", "explained variance", False),
    ("train/learning_rate", "learning rate", False),
    ("train/grad_norm", "gradient norm (before clipping)", True),
    ("perf/sps", "env steps per second", False),
)


#: line styles of the overlaid runs: the parent, then each compared run in turn
OVERLAY_STYLES: tuple[Any, ...] = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
OVERLAY_ALPHA = 0.55
_STYLE_NAMES = {"--": "dashed", ":": "dotted", "-.": "dash-dotted"}


def components(run: RunRecords, probe: str, metric: str, layers: bool = True) -> list[str]:
    """Names with a ``probes/<probe>/<name>/<metric>`` series; ``layers=False`` leaves out
    the layers of another recorded name (see :func:`layer_groups`)."""
    from policy_probes.analysis.layer_figures import layer_groups

    prefix, suffix = f"probes/{probe}/", f"/{metric}"
    names = sorted(
        k[len(prefix) : -len(suffix)]
        for k in run.scalars
        if k.startswith(prefix) and k.endswith(suffix)
    )
    if layers:
        return names
    inner = {layer for group in layer_groups(names).values() for layer in group}
    return [n for n in names if n not in inner]


@dataclass
class Overlay:
    """Another run drawn over the report's: its parent (``fork_epoch`` set) or a compared one."""

    label: str
    run: RunRecords
    linestyle: Any
    fork_epoch: int | None = None


def find_overlays(
    run_dir: Path, config: dict[str, Any] | None, compare: Sequence[Path] = ()
) -> tuple[list[Overlay], list[str]]:
    """The parent named in ``config`` (a relative path from the working directory, else
    beside ``run_dir``) and the ``compare`` runs as overlays, and a note for each unread."""
    overlays: list[Overlay] = []
    notes: list[str] = []
    styles = iter(OVERLAY_STYLES * (1 + len(compare)))
    parent = (config or {}).get("parent")
    if isinstance(parent, dict) and parent.get("run_dir"):
        where = Path(parent["run_dir"])
        candidates = [where] if where.is_absolute() else [where, run_dir.parent / where.name]
        found = next((c for c in candidates if (c / METRICS_JSONL).is_file()), None)
        if found is None:
            notes.append(f"parent run {where} (no {METRICS_JSONL} found)")
        else:
            epoch = parent.get("epoch") if isinstance(parent.get("epoch"), int) else None
            label = f"parent {found.resolve().name}"
            overlays.append(Overlay(label, RunRecords.read(found), next(styles), epoch))
    else:
        next(styles)  # the dashed style stays the parent's
    for other in compare:
        path = Path(other) / METRICS_JSONL
        if not path.is_file():
            notes.append(f"compared run {other} (no {METRICS_JSONL})")
            continue
        overlays.append(Overlay(Path(other).resolve().name, RunRecords.read(other), next(styles)))
    return overlays, notes


def _plot(
    ax,
    run: RunRecords,
    key: str,
    overlays: Sequence[Overlay],
    name: str | None = None,
    log: bool = False,
    label: str | None = None,
) -> None:
    """Draw ``key`` of ``run`` (labelled ``label``, default ``name``) and, in its colour
    and their own style, of each overlaid run that has it (labelled ``name [overlay]``)."""
    from policy_probes.analysis.layer_figures import plot_series

    line = plot_series(ax, run.series(key), label=label or name, log=log)
    for o in overlays:
        if key in o.run.scalars:
            tagged = None if name is None else f"{name} [{o.label}]"
            style = {"color": line.get_color(), "linestyle": o.linestyle, "alpha": OVERLAY_ALPHA}
            plot_series(ax, o.run.series(key), label=tagged, log=log, **style)


def _fork_lines(ax, overlays: Sequence[Overlay]) -> None:
    for o in overlays:
        if o.fork_epoch is not None:
            label = f"fork after epoch {o.fork_epoch}"
            ax.axvline(o.fork_epoch, color="0.35", linestyle=":", linewidth=1.2, label=label)


def returns_figure(run: RunRecords, overlays: Sequence[Overlay] = ()) -> Figure | None:
    from policy_probes.analysis.layer_figures import panel_grid, style_axes

    present = [(k, label) for k, label in RETURN_KEYS if k in run.scalars]
    if not present:
        return None
    fig, (ax,) = panel_grid(1, cols=1, height=3.4, width=10.4)
    for key, label in present:
        _plot(ax, run, key, overlays, label, label=f"{label} ({key})")
    _fork_lines(ax, overlays)
    style_axes(ax, "Episode return", ylabel="return")
    ax.legend(fontsize=8)
    return fig


def training_figure(run: RunRecords, overlays: Sequence[Overlay] = ()) -> Figure | None:
    from policy_probes.analysis.layer_figures import panel_grid, style_axes

    present = [(k, t, log) for k, t, log in TRAIN_KEYS if k in run.scalars]
    if not present:
        return None
    fig, axes = panel_grid(len(present), cols=3, height=2.5)
    for ax, (key, title, log) in zip(axes, present, strict=True):
        _plot(ax, run, key, overlays, log=log)
        _fork_lines(ax, overlays)
        style_axes(ax, f"{title}\n{key}", log=log)
    return fig


def probe_figure(
    run: RunRecords,
    panels: Sequence[Panel],
    overlays: Sequence[Overlay] = (),
) -> Figure | None:
    """One panel per metric, one line per component (its layers are drawn per layer)."""
    from policy_probes.analysis.layer_figures import panel_grid, style_axes

    present = [p for p in panels if components(run, p.probe, p.metric)]
    if not present:
        return None
    fig, axes = panel_grid(len(present), cols=2, height=3.0)
    for ax, (probe, metric, title, log, _) in zip(axes, present, strict=True):
        for comp in components(run, probe, metric, layers=False):
            _plot(ax, run, f"probes/{probe}/{comp}/{metric}", overlays, comp, log=log)
        _fork_lines(ax, overlays)
        if not log and metric.endswith("fraction"):
            ax.set_ylim(-0.03, 1.03)
        style_axes(ax, title, log=log)
        ax.legend(fontsize=8, title="component", title_fontsize=8)
    return fig


def heatmap_figures(run: RunRecords, max_epochs: int | None = None) -> list[tuple[str, Figure]]:
    """One units x epochs heatmap per component and per-unit metric of :data:`HEATMAP_SPECS`."""
    from policy_probes.analysis.heatmaps import (
        HEATMAP_SPECS,
        component_of,
        heatmap_figure,
        heatmap_matrices,
    )

    order = list(HEATMAP_SPECS.values())
    found = sorted(heatmap_matrices(run, max_epochs), key=lambda h: (order.index(h[1]), h[0]))
    out = []
    for key, spec, matrix, epochs in found:
        figsize = (10.4, min(2.2 + 0.06 * matrix.shape[0], 7.5))
        out.append((key, heatmap_figure(matrix, epochs, spec, component_of(key), figsize=figsize)))
    return out


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1120px;
color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:32px;border-bottom:1px solid #ddd;
padding-bottom:4px} .meta{color:#555;font-size:13px} img{max-width:100%;display:block;margin:8px 0}
table{border-collapse:collapse;font-size:12px} td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:right} td:first-child,th:first-child{text-align:left;font-family:ui-monospace,monospace}
details{margin:8px 0} pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto;max-height:400px}
.note{color:#777;font-size:13px}
"""


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}"


def _img(fig: Figure, alt: str) -> str:
    from policy_probes.analysis.heatmaps import figure_png

    png = base64.b64encode(figure_png(fig)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">'


def _scalar_table(run: RunRecords) -> str:
    rows = []
    for key in sorted(run.scalars):
        values = [v for _, v in sorted(run.scalars[key].items())]
        finite = [v for v in values if math.isfinite(v)]
        last = values[-1] if values else math.nan
        cells = (last, min(finite, default=math.nan), max(finite, default=math.nan))
        shown = "".join(f"<td>{_fmt(v)}</td>" for v in cells)
        rows.append(f"<tr><td>{html.escape(key)}</td>{shown}<td>{len(values)}</td></tr>")
    head = "<tr><th>metric</th><th>last</th><th>min</th><th>max</th><th>epochs</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def build_report(
    run_dir: Path,
    out: Path | None = None,
    *,
    max_heatmap_epochs: int | None = 1000,
    compare: Sequence[Path] = (),
) -> Path:
    """Write the HTML dashboard of ``run_dir`` (default ``run_dir/report.html``) and
    return its path, a fork's parent and the ``compare`` runs overlaid. Raises
    ``FileNotFoundError`` without metrics.jsonl, ``ValueError`` when ``max_heatmap_epochs``
    is neither None nor >= 1."""
    from policy_probes.analysis.layer_figures import LAYER_SECTIONS, PROBE_SECTIONS, layer_figures

    if max_heatmap_epochs is not None and max_heatmap_epochs < 1:
        raise ValueError(
            f"max_heatmap_epochs must be >= 1 (or None for every epoch), got {max_heatmap_epochs}"
        )
    run_dir = Path(run_dir)
    run = RunRecords.read(run_dir)
    out = Path(out) if out is not None else run_dir / REPORT_HTML
    epochs = run.epochs
    parts: list[str] = []
    name = run_dir.resolve().name
    title = f"policy-probes report: {name}"
    steps = max(run.agent_step.values()) if run.agent_step else None
    parts.append(f"<h1>{html.escape(title)}</h1>")
    meta = [f"run <code>{html.escape(name)}</code>"]  # no local path in a shared file
    if epochs:
        meta.append(f"epochs {epochs[0]}-{epochs[-1]} ({len(epochs)})")
    if steps is not None:
        meta.append(f"{steps:,} environment steps")
    meta += [f"{run.records} records", f"generated {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    parts.append(f'<p class="meta">{" &middot; ".join(meta)}</p>')
    config_path = run_dir / "config.json"
    config: dict[str, Any] | None = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
            config_text = json.dumps(config, indent=2)
        except (json.JSONDecodeError, OSError):
            config_text = config_path.read_text(errors="replace")
        for where in {str(run_dir.resolve()), str(run_dir.absolute())}:  # run_dir=/abs/path
            config_text = config_text.replace(where, name)
        parts.append(
            f"<details><summary>configuration</summary><pre>{html.escape(config_text)}</pre></details>"
        )
    overlays, unread = find_overlays(run_dir, config if isinstance(config, dict) else None, compare)
    if overlays:
        drawn = "; ".join(
            f"{html.escape(o.label)}: {_STYLE_NAMES.get(o.linestyle, 'dashed pattern')}"
            + (f", forked after epoch {o.fork_epoch}" if o.fork_epoch is not None else "")
            for o in overlays
        )
        parts.append(
            f'<p class="note">Overlaid (same colours, faded): {drawn}. Solid lines: this run.</p>'
        )
    if unread:
        parts.append(f'<p class="note">Not overlaid: {html.escape("; ".join(unread))}.</p>')
    if not epochs:
        parts.append('<p class="note">metrics.jsonl holds no epoch yet.</p>')
    else:  # what is going wrong, first (policy_probes.analysis.findings)
        parts.append(render_findings_html(*judge(run, run_rules(run_dir))))
    missing: list[str] = []
    losses = training_figure(run, overlays)
    sections = [
        (returns_figure(run, overlays), "<h2>Returns</h2>", "episode return per epoch", "returns"),
        (losses, "<h2>Losses and PPO statistics</h2>", "losses per epoch", "losses"),
    ]
    for slug, section, panels in PROBE_SECTIONS:
        heading = f'<h2 id="{slug}">{html.escape(section)} per component</h2>'
        sections.append((probe_figure(run, panels, overlays), heading, section, section.lower()))
    for fig, heading, alt, name in sections:
        if fig is not None:
            parts += [heading, _img(fig, alt)]
        else:
            missing.append(name)
    per_layer = layer_figures(run)
    for slug, section, _ in LAYER_SECTIONS:
        figures = [(comp, f) for s, comp, f in per_layer if s == slug]
        if figures:
            parts.append(f'<h2 id="{slug}-layers">{html.escape(section)} per layer</h2>')
            parts += [_img(f, f"{section} per layer: {comp}") for comp, f in figures]
    heatmaps = heatmap_figures(run, max_heatmap_epochs)
    if heatmaps:
        parts += [
            '<h2 id="heatmaps">Units x epochs</h2>',
            '<p class="note">One row per unit, one column per epoch. Red: ReLU units with active '
            "rate 0 (dead) in that epoch; black: per-unit Fisher or gradient RMS of exactly 0; "
            "grey: not recorded.</p>",
            *(_img(f, key) for key, f in heatmaps),
        ]
    else:
        missing.append("per-unit heatmaps")
    if missing:
        parts.append(
            f'<p class="note">Not recorded in this run: {html.escape(", ".join(missing))}.</p>'
        )
    if run.scalars:
        parts += ["<h2>All scalar metrics</h2>", _scalar_table(run)]
    document = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, document)  # a failed report leaves nothing behind
    return out


def add_report_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """``policy-probes report RUN_DIR [--out FILE]``."""
    p = subparsers.add_parser(
        "report",
        help="build the local HTML dashboard of a run",
        description="Build RUN_DIR/report.html (self-contained, PNG figures) from "
        "RUN_DIR/metrics.jsonl; a forked run's parent and the --compare runs are overlaid.",
    )
    p.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    p.add_argument(
        "--out", type=Path, default=None, help="output file (default RUN_DIR/report.html)"
    )
    p.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=[],
        metavar="OTHER_RUN_DIR",
        help="overlay these runs' returns, losses and probe curves (a fork's parent is "
        "overlaid without it)",
    )
    p.add_argument(
        "--max-heatmap-epochs",
        type=positive_int,
        default=1000,
        help="heatmaps show the last N epochs (default 1000)",
    )
    p.set_defaults(handler=report_command)


def report_command(args: argparse.Namespace) -> int:
    """Handler of ``report``: 0 on success, 2 when the run directory has no metrics."""
    missing = [str(c) for c in args.compare if not (Path(c) / METRICS_JSONL).is_file()]
    if missing:
        return cli_error(
            "report",
            f"--compare {', '.join(missing)}: no {METRICS_JSONL} there; give the directories of runs",
        )
    if args.out is not None and args.out.is_dir():
        args.out = args.out / "report.html"  # --out DIR/: the report inside it
    try:
        path = build_report(
            args.run_dir, args.out, max_heatmap_epochs=args.max_heatmap_epochs, compare=args.compare
        )
    except FileNotFoundError as exc:
        return cli_error("report", str(exc))
    except OSError as exc:  # --out in a missing or read-only directory
        return cli_error("report", f"cannot write the report ({exc}); choose a writable --out")
    print(f"report written to {path}")
    return 0
