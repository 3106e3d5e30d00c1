"""Plasticity experiment: permuted-observation CartPole, with and without each remedy.

Every run is ``recipes.cartpole_permuted.train_measured`` (CartPole whose 4 observation
features are permuted every ``--period`` epochs; docs/plasticity.md) with the overrides of
one arm of :data:`ARMS`, exactly as ``policy-probes run ... key=value`` would apply them;
the same seed gives every arm the same permutations. It writes the figure (``--figure``:
return smoothed over 10 epochs and dormant fractions, mean and +-1 std over seeds), every
run's curves (``--results``) and the tables in ``--doc`` between the
``plasticity:begin``/``plasticity:end`` markers (and ``plasticity-measures`` ones).

    nice python -m benchmarks.plasticity --seeds 1,2,3,4,5 --jobs 2     # make plasticity
    python -m benchmarks.plasticity --from-results     # redraw figure and tables only
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.ab import write_json

RECIPE = "recipes.cartpole_permuted.train_measured"
COMPONENTS = ("actor_mlp", "critic_mlp")
BATCH = 4 * 128  # agent steps per epoch (the recipe's 4 envs x 128 steps)


def _both(name: str, key: str) -> dict[str, str]:
    """``name_actor`` and ``name_critic``: ``key`` with ``{c}`` as each MLP."""
    return {f"{name}_{c.removesuffix('_mlp')}": key.format(c=c) for c in COMPONENTS}


def _layers(name: str, key: str) -> dict[str, str]:
    """``name_actor_l0`` ... ``name_critic_l1``: ``key`` with ``{c}`` as each MLP's layer."""
    return {
        f"{name}_{c.removesuffix('_mlp')}_l{i}": key.format(c=f"{c}.layer_{i}")
        for c in COMPONENTS
        for i in (0, 1)
    }


#: the plasticity measures kept (name -> POST_EPOCH key), as per-period means
MEASURES: dict[str, str] = {
    **_both("dormant", "probes/relu/{c}/dormant_fraction"),
    **_both("dormant_tau0.1", "probes/relu/{c}/dormant_fraction_tau_0.1"),
    **_both("dead", "probes/relu/{c}/dead_fraction"),
    "policy_kl": "probes/churn/actor_head/policy_kl",
    "value_change": "probes/churn/critic_head/value_change",
    **_both("weight_norm", "probes/weights/{c}/norm"),
    **_both("init_distance", "probes/weights/{c}/init_distance"),
    **_both("update_ratio", "probes/weights/{c}/update_ratio"),
    **_layers("preact_drift", "probes/preactivation/{c}.linear/mean_drift"),
    **_both("feature_norm", "probes/preactivation/{c}/feature_norm"),
    **_layers("low_utility", "probes/utility/{c}/low_utility_fraction"),
    **_both("fisher_trace", "probes/fisher/{c}/trace"),
    **_both("noise_scale", "probes/fisher/{c}/grad_noise_scale"),
    "value_target_std": "train/value_target_std",
    **_both("trainability", "probes/trainability/{c}/ratio"),
    **_both("dead_ref", "probes/relu/{c}/dead_fraction_ref"),
}
ARMS: dict[str, list[str]] = {
    "none": [],
    "redo": [f"redo@{c}:tau=0.1,every_epochs=10" for c in COMPONENTS],
    "shrink_and_perturb": [
        f"shrink_and_perturb@{c}:shrink=0.8,noise=0.01,every_epochs=10" for c in COMPONENTS
    ],
    "reset_layers": [f"reset_layers@{c}:last=1,every_epochs=40" for c in COMPONENTS],
}
RETURN_KEY = "rollout/episode_return"
SMOOTH = 10  # epochs in the figure's moving average of the return
BEGIN, END = "<!-- plasticity:begin -->", "<!-- plasticity:end -->"
NO_CHECKPOINTS = ["checkpoint.every_epochs=0", "checkpoint.at_end=false"]


def base_overrides(seed: int, epochs: int, period: int, run_dir: Path) -> list[str]:
    """The ``key=value`` overrides every run of the experiments shares: seed, length,
    permutation period, run directory, and no console, CSV, TensorBoard or W&B."""
    return [
        f"seed={seed}",
        f"run_dir={run_dir}",
        f"trainer.total_timesteps={epochs * BATCH}",
        f"env.permute_obs_every={period * BATCH}",
        "sinks.console=false",
        "sinks.csv=false",
        "sinks.tensorboard=false",
        "wandb.mode=disabled",
    ]


def run_overrides(arm: str, seed: int, epochs: int, period: int, run_dir: Path) -> list[str]:
    """The overrides of one run: :func:`base_overrides`, no checkpoints, the arm's remedies."""
    out = base_overrides(seed, epochs, period, run_dir) + NO_CHECKPOINTS
    return out + ([f"remedies={json.dumps(ARMS[arm])}"] if ARMS[arm] else [])


def curves(run_dir: Path, epochs: int) -> dict[str, list[float]]:
    """Per-epoch return, dormant fractions, measures and units reset (NaN: not recorded)
    from the run's POST_EPOCH records."""
    from policy_probes.records import RunRecords

    run = RunRecords.read(run_dir)

    def column(key: str) -> list[float]:
        values = run.scalars.get(key, {})
        return [float(values.get(e, math.nan)) for e in range(1, epochs + 1)]

    resets = [
        values
        for k, values in run.scalars.items()
        if k.startswith("remedies/")
        and k.endswith("/units_reset")
        and k.split("/")[2] in COMPONENTS
    ]
    return {
        "return": column(RETURN_KEY),
        **{c: column(f"probes/relu/{c}/dormant_fraction") for c in COMPONENTS},
        **{name: column(key) for name, key in MEASURES.items()},
        "units_reset": [
            float(sum(v for r in resets if math.isfinite(v := r.get(e, 0.0))))
            for e in range(1, epochs + 1)
        ],
    }


def run_one(job: tuple[str, int, int, int, str]) -> dict[str, Any]:
    """Train one arm with one seed; its curves, findings and wall time."""
    arm, seed, epochs, period, out_root = job
    import torch

    from policy_probes.analysis.findings import diagnose_run
    from policy_probes.overrides import apply_overrides
    from policy_probes.recipe_launch import load_recipe

    torch.set_num_threads(1)
    run_dir = Path(out_root) / f"{arm}-seed{seed}"
    tool = apply_overrides(load_recipe(RECIPE)(), run_overrides(arm, seed, epochs, period, run_dir))
    t0 = time.perf_counter()
    tool.invoke(overwrite=True)
    wall = time.perf_counter() - t0
    keys = ("rule", "component", "metric", "onset_epoch", "value", "baseline")
    findings = [{k: f.to_dict()[k] for k in keys} for f in diagnose_run(run_dir)]
    return {
        "arm": arm,
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_seconds": wall,
        "findings": findings,
        **curves(run_dir, epochs),
    }


# ---------------------------------------------------------------------- summary
def period_means(values: list[float], period: int) -> np.ndarray:
    """Mean of ``values`` over each period (NaN-aware)."""
    v = np.asarray(values, dtype=float)
    n = len(v) // period
    with np.errstate(all="ignore"):
        return np.array([np.nanmean(v[k * period : (k + 1) * period]) for k in range(n)])


def summarize(runs: list[dict[str, Any]], period: int) -> dict[str, Any]:
    """Per run: return over all epochs, over the first and last three periods and the last
    period, and the relative change of the mean return from the first half of the periods
    to the second; dormant fractions over the last period; units reset in all."""
    out = {}
    for r in runs:
        ret = period_means(r["return"], period)
        k = min(3, len(ret))
        half = len(ret) // 2
        first, second = np.nanmean(ret[:half]), np.nanmean(ret[half:])
        out[f"{r['arm']}/{r['seed']}"] = {
            "return_all": float(np.nanmean(r["return"])),
            "return_change": float(100 * (second - first) / first) if half else math.nan,
            "return_first3": float(np.nanmean(ret[:k])),
            "return_last3": float(np.nanmean(ret[-k:])),
            "return_last": float(ret[-1]),
            **{
                f"dormant_{c.removesuffix('_mlp')}_last": float(period_means(r[c], period)[-1])
                for c in COMPONENTS
            },
            "units_reset": float(np.sum(r["units_reset"])),
        }
    return out


COLUMNS = (
    ("return_all", "return, all epochs", "{:.0f}"),
    ("return_first3", "return, first 3 periods", "{:.0f}"),
    ("return_last3", "return, last 3 periods", "{:.0f}"),
    ("return_last", "return, last period", "{:.0f}"),
    ("return_change", "return change, 2nd half vs 1st (%)", "{:+.0f}"),
    ("dormant_actor_last", "dormant actor, last period", "{:.3f}"),
    ("dormant_critic_last", "dormant critic, last period", "{:.3f}"),
    ("units_reset", "units reset per run", "{:.0f}"),
)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``head`` and ``rows``."""
    lines = ["| " + " | ".join(cells) + " |" for cells in (head, *rows)]
    return "\n".join([lines[0], "|" + "---|" * len(head), *lines[1:]])


def table(summary: dict[str, Any], arms: list[str], seeds: list[int]) -> str:
    """Markdown table: mean +- std over seeds for each arm."""
    rows = []
    for arm in arms:
        cells = [arm]
        for key, _, fmt in COLUMNS:
            values = np.array([summary[f"{arm}/{s}"][key] for s in seeds])
            spread = f" ± {fmt.replace('+', '').format(values.std())}" if len(values) > 1 else ""
            cells.append(fmt.format(values.mean()) + spread)
        rows.append(cells)
    return markdown(["arm", *(title for _, title, _ in COLUMNS)], rows)


def moving_mean(v: np.ndarray, width: int) -> np.ndarray:
    """Trailing NaN-aware mean over ``width`` epochs."""
    out = np.full(len(v), np.nan)
    for i in range(len(v)):
        window = v[max(0, i - width + 1) : i + 1]
        if np.isfinite(window).any():
            out[i] = np.nanmean(window)
    return out


def figure(runs: list[dict[str, Any]], arms: list[str], period: int, path: Path) -> None:
    """Return (moving mean) and dormant fractions per epoch: mean over seeds, +-1 std band."""
    from matplotlib.figure import Figure

    panels = [
        ("return", f"training episode return ({SMOOTH}-epoch mean)"),
        *((c, f"dormant fraction, {c} (tau 0.025)") for c in COMPONENTS),
    ]
    fig = Figure(figsize=(10, 9), dpi=110, layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for arm in arms:
            rows = [np.asarray(r[key], float) for r in runs if r["arm"] == arm]
            if key == "return":
                rows = [moving_mean(v, SMOOTH) for v in rows]
            data = np.vstack(rows)
            with np.errstate(all="ignore"):
                mean, std = np.nanmean(data, axis=0), np.nanstd(data, axis=0)
            x = np.arange(1, data.shape[1] + 1)
            (line,) = ax.plot(x, mean, linewidth=1.4, label=arm)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        for switch in range(period, data.shape[1], period):
            ax.axvline(switch + 0.5, color="0.6", linewidth=0.6, linestyle=":")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, ncols=len(arms))
    axes[-1].set_xlabel(f"epoch (512 agent steps; dotted: a new permutation every {period})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def plain(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with NaN (epochs without a value) as null, for strict JSON."""

    def finite(x: Any) -> Any:
        return None if isinstance(x, float) and math.isnan(x) else x

    return {k: [finite(x) for x in v] if isinstance(v, list) else finite(v) for k, v in run.items()}


def write_doc(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``block`` between the markers of ``path`` (created with them if missing)."""
    text = path.read_text() if path.is_file() else f"# Plasticity experiment\n\n{begin}\n{end}\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


# ---------------------------------------------------------------------- measures
MEASURES_BEGIN = "<!-- plasticity-measures:begin -->"
MEASURES_END = "<!-- plasticity-measures:end -->"
PERMUTATIONS = 10_000  # of the permutation test of each rank correlation
DECLINE = 0.9  # the return has declined once the later periods average below 90 % of the peak


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        r[tied] = r[tied].mean()
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Spearman's rho (Pearson's r of the ranks) and a two-sided permutation p-value
    (``PERMUTATIONS`` shuffles of y with a fixed seed: the same numbers on every rerun)."""
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx**2).sum() * (ry**2).sum()))
    if denom == 0:
        return math.nan, math.nan
    rho = float((rx * ry).sum()) / denom
    g = np.random.default_rng(0)
    perm = np.array([float((rx * g.permutation(ry)).sum()) / denom for _ in range(PERMUTATIONS)])
    p = (1 + int((np.abs(perm) >= abs(rho) - 1e-12).sum())) / (PERMUTATIONS + 1)
    return rho, p


def measure_change(means: list[float]) -> float:
    """Mean over the second half of the periods minus the mean over the first half, from
    the per-period means (what the results keep of each measure)."""
    means = np.asarray([math.nan if v is None else v for v in means], dtype=float)
    half = len(means) // 2
    with np.errstate(all="ignore"):
        return float(np.nanmean(means[half:]) - np.nanmean(means[:half]))


def correlation_table(runs: list[dict[str, Any]], summary: dict[str, Any], arms: list[str]) -> str:
    """One row per measure: Spearman's rho between its change (2nd half - 1st half) and
    the return change across every run (all seeds and arms), its permutation p, and the
    mean change per arm."""
    ret = np.array([summary[f"{r['arm']}/{r['seed']}"]["return_change"] for r in runs])
    rows = []
    for name, key in MEASURES.items():
        if not any(name in r for r in runs):
            continue
        change = np.array([measure_change(r[name]) for r in runs])
        ok = np.isfinite(change) & np.isfinite(ret)
        rho, p = spearman(change[ok], ret[ok]) if ok.sum() >= 3 else (math.nan, math.nan)
        per_arm = []
        for a in arms:
            v = change[[r["arm"] == a for r in runs]]
            per_arm.append(f"{np.nanmean(v):+.3g}" if np.isfinite(v).any() else "–")
        rows.append([name, f"`{key}`", f"{rho:+.2f} (n={int(ok.sum())})", f"{p:.3f}", *per_arm])
    head = ["measure", "key", "rho with return change", "p", *(f"change, {a}" for a in arms)]
    return markdown(head, rows)


def decline_epoch(values: list[float], period: int) -> int | None:
    """The first epoch of the period after the best period of the first half, when the
    periods after it average below ``DECLINE`` of that best period's return; None when
    they do not (no decline)."""
    means = period_means(values, period)
    half = len(means) // 2
    if half < 1 or not np.isfinite(means[:half]).any():
        return None
    peak = int(np.nanargmax(means[:half]))
    rest = means[peak + 1 :]
    if not len(rest) or not np.nanmean(rest) < DECLINE * means[peak]:
        return None
    return (peak + 1) * period + 1


def replay_findings(run_dir: Path, rules: Any = None) -> tuple[dict[tuple[str, str], int], list]:
    """The run's epoch records fed one by one to the incremental engine, as a live
    ``policy-probes diagnose`` would have read them (``rules``: the default rules when
    None): the first epoch each (rule, component) showed, and the findings at the end."""
    from policy_probes.analysis.findings import FindingsEngine
    from policy_probes.records import POST_EPOCH, Record, RunRecords, iter_jsonl

    records, engine = RunRecords(), FindingsEngine(rules)
    first: dict[tuple[str, str], int] = {}
    for line in iter_jsonl(run_dir / "metrics.jsonl"):
        if line.get("hook_point") != POST_EPOCH:
            continue
        records.add(Record.from_json(line))
        engine.update(records)  # what a diagnose of the records so far finds
        for f in engine.findings():
            first.setdefault((f.rule, f.component), line["epoch"])
    return first, engine.findings()


def first_fires(run_dir: Path) -> list[dict[str, Any]]:
    """Every finding a live ``policy-probes diagnose`` would have shown during the run:
    for each rule and component, the first epoch at which diagnosing the run's records
    up to that epoch yields it, and whether it still holds at the run's end (with its
    onset then)."""
    first, end = replay_findings(run_dir)
    at_end = {(f.rule, f.component): f.onset_epoch for f in end}
    return [
        dict(rule=rule, component=comp, first_epoch=epoch, onset_at_end=at_end.get((rule, comp)))
        for (rule, comp), epoch in first.items()
    ]


def held(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The findings of the run's :func:`first_fires` that still hold at its end."""
    return [f for f in run.get("first_fires", []) if f["onset_at_end"] is not None]


def lead_table(runs: list[dict[str, Any]], period: int, arm: str = "none") -> str:
    """Per seed of ``arm``: the epoch the return starts to fall, and for each finding at
    the run's end the epoch a live diagnose first showed it and its lead (decline epoch
    minus that epoch: positive = the finding came first)."""
    chosen = [r for r in runs if r["arm"] == arm and "first_fires" in r]
    kinds = sorted({(f["rule"], f["component"]) for r in chosen for f in held(r)})
    if not kinds:
        return "(no finding held at the end of a run)"
    rows = []
    for r in chosen:
        decline = decline_epoch(r["return"], period)
        fired = {(f["rule"], f["component"]): f["first_epoch"] for f in held(r)}
        cells = [str(r["seed"]), str(decline) if decline is not None else "no decline"]
        for kind in kinds:
            first = fired.get(kind)
            if first is None:
                cells.append("–")
            elif decline is None:
                cells.append(f"{first}")
            else:
                cells.append(f"{first} ({decline - first:+d})")
        rows.append(cells)
    head = ["seed", "return starts to fall", *(f"{rule} {comp}" for rule, comp in kinds)]
    return markdown(head, rows)


def findings_table(runs: list[dict[str, Any]], arms: list[str], period: int) -> str:
    """Per rule: in how many runs of each arm it holds at the run's end, and the median
    lead over the runs whose return declines."""
    rows = []
    for rule in sorted({f["rule"] for r in runs for f in held(r)}):
        cells, leads = [rule], []
        for a in arms:
            mine = [r for r in runs if r["arm"] == a]
            firsts = [[f["first_epoch"] for f in held(r) if f["rule"] == rule] for r in mine]
            cells.append(f"{sum(map(bool, firsts))}/{len(mine)}")
            for r, epochs in zip(mine, firsts, strict=True):
                decline = decline_epoch(r["return"], period) if epochs else None
                if decline is not None:
                    leads.append(decline - min(epochs))
        cells.append(f"{np.median(leads):+.0f} (n={len(leads)})" if leads else "–")
        rows.append(cells)
    head = ["rule", *(f"runs, {a}" for a in arms), "median lead (epochs), runs with a decline"]
    return markdown(head, rows)


def measures_block(
    runs: list[dict[str, Any]], summary: dict[str, Any], arms: list[str], period: int
) -> str:
    """The doc section on the plasticity measures: correlations, findings, lead times."""
    declines = [(r["seed"], decline_epoch(r["return"], period)) for r in runs if r["arm"] == "none"]
    none_declines = ", ".join(f"seed {s}: {'none' if e is None else e}" for s, e in declines)
    return (
        "Rank correlation (Spearman) across all runs (seeds x arms) between each measure's "
        "change (mean over periods 7-12 minus mean over periods 1-6) and the return change "
        f"(the same halves, %); p from {PERMUTATIONS} permutations:\n\n"
        f"{correlation_table(runs, summary, arms)}\n\n"
        "Findings (`policy-probes diagnose`) that hold at the end of the run, per arm, and "
        "their median lead over the return's decline (decline epoch minus the epoch a live "
        "`diagnose` first showed the finding; positive: the finding came first):\n\n"
        f"{findings_table(runs, arms, period)}\n\n"
        f"Per seed without a remedy (return decline epochs: {none_declines}); each cell: the "
        "epoch a live `diagnose` first showed the finding (its lead in epochs):\n\n"
        f"{lead_table(runs, period)}\n\n"
        + "\n\n".join(
            f"Trainability ratio of {c} per period (`probes/trainability/{c}/ratio`, measured "
            f"every 10 epochs; mean over seeds):\n\n"
            # kept as per-period means already (MEASURES): periods of one value each
            + period_table(runs, arms, f"trainability_{c.removesuffix('_mlp')}", 1, "{:.2f}")
            for c in COMPONENTS
        )
    )


def period_table(
    runs: list[dict[str, Any]], arms: list[str], key: str, period: int, fmt: str
) -> str:
    """Markdown table: one row per arm, one column per period, the mean over seeds of
    ``key``'s per-period mean."""
    rows = []
    for arm in arms:
        means = np.vstack([period_means(r[key], period) for r in runs if r["arm"] == arm])
        with np.errstate(all="ignore"):
            rows.append([arm, *(fmt.format(v) for v in np.nanmean(means, 0))])
    n = len(runs[0][key]) // period
    return markdown(["arm", *(str(k + 1) for k in range(n))], rows)


# ---------------------------------------------------------------------- command line
def load_results(path: Path) -> dict[str, Any]:
    """A results file written by :func:`publish`, null values back to NaN."""
    data = json.loads(path.read_text())
    data["runs"] = [
        {
            k: [math.nan if x is None else x for x in v] if isinstance(v, list) else v
            for k, v in r.items()
        }
        for r in data["runs"]
    ]
    return data


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options the plasticity experiments share; ``name`` names their default outputs."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds")
    p.add_argument("--epochs", type=int, default=480, help="epochs per run (512 steps each)")
    p.add_argument("--period", type=int, default=40, help="epochs between permutations")
    p.add_argument("--out", default=f"runs/{name}", help="run directories go here")
    p.add_argument("--results", default=f"benchmarks/results/{name}.json")
    p.add_argument("--figure", default=f"docs/figures/{name}.png")
    p.add_argument("--doc", default="docs/plasticity.md")
    p.add_argument(
        "--from-results",
        action="store_true",
        help="train nothing: redraw the figure and tables from the --results file",
    )
    return p


def command(module: str, argv: list[str] | None) -> str:
    """The command line that ran ``module`` with ``argv`` (the process's arguments by default)."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def publish(
    data: dict[str, Any], args: argparse.Namespace, name: str, how: str, components: tuple[str, ...]
) -> tuple[dict[str, Any], str, str]:
    """Write ``data`` with every run's summary to ``--results`` and draw ``--figure``;
    the summary, the markdown table and the doc block: the command (run as ``how``), the
    table, the figure (``name``) and the per-period return and dormant fractions of
    ``components``."""
    runs, arms, seeds, period = data["runs"], list(data["arms"]), data["seeds"], data["period"]
    summary = summarize(runs, period)
    plain_summary = {k: plain(v) for k, v in summary.items()}
    write_json(
        Path(args.results),
        {**data, "summary": plain_summary, "runs": [plain(r) for r in runs]},
        None,
    )
    figure(runs, arms, period, Path(args.figure))
    md = table(summary, arms, seeds)
    tables = [("Training episode return", period_table(runs, arms, "return", period, "{:.0f}"))]
    tables += [
        (f"Dormant fraction of {c}", period_table(runs, arms, c, period, "{:.2f}"))
        for c in components
    ]
    block = (
        f"Reproduce: `nice {data['command']}` ({how}). {len(seeds)} seeds "
        f"({', '.join(map(str, seeds))}), {data['epochs']} epochs of 512 agent steps, a new "
        f"permutation every {period} epochs; mean ± std over seeds.\n\n{md}\n\n"
        f"![{name}]({os.path.relpath(args.figure, Path(args.doc).parent)})\n\n"
        + "\n\n".join(f"{title} per period (mean over seeds):\n\n{t}" for title, t in tables)
    )
    return summary, md, block


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "plasticity")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (one core each)")
    args = p.parse_args(argv)
    data = load_results(Path(args.results)) if args.from_results else train_arms(p, args, argv)
    runs, period = data["runs"], data["period"]
    for r in runs:  # what a live diagnose showed, from the run's records when they are here
        if "first_fires" not in r and (Path(r["run_dir"]) / "metrics.jsonl").is_file():
            r["first_fires"] = first_fires(Path(r["run_dir"]))
        # the measures are kept as per-period means (their per-epoch values stay in the
        # run's metrics.jsonl): 20 runs x 29 measures x 480 epochs would be megabytes
        for name in MEASURES:
            if name in r and len(r[name]) == data["epochs"]:
                r[name] = [float(v) for v in period_means(r[name], period)]
    how = f"{len(runs)} runs, {data['wall_seconds'] / 60:.1f} min wall with --jobs {data['jobs']}"
    summary, md, block = publish(data, args, "plasticity", how, COMPONENTS)
    doc = Path(args.doc)
    write_doc(doc, block)
    if MEASURES_BEGIN in doc.read_text() and any(name in r for r in runs for name in MEASURES):
        # only into a doc that has the section's markers (docs/plasticity.md does)
        arms = list(data["arms"])
        write_doc(doc, measures_block(runs, summary, arms, period), MEASURES_BEGIN, MEASURES_END)
    print(md)
    print(f"figure: {args.figure}; tables: {args.doc}; results: {Path(args.results)}")
    return 0


def train_arms(
    p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None
) -> dict[str, Any]:
    """Run every arm x seed; the results (configuration, curves, wall time)."""
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not seeds or args.epochs < 1 or args.period < 1:
        p.error(f"unknown arms {unknown} (choose from {list(ARMS)}), or no seeds / epochs < 1")
    jobs = [(a, s, args.epochs, args.period, args.out) for a in arms for s in seeds]
    t0 = time.perf_counter()
    if args.jobs == 1:
        runs = [run_one(j) for j in jobs]
    else:
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            runs = pool.map(run_one, jobs, chunksize=1)
    return {
        "command": command("benchmarks.plasticity", argv),
        "arms": {a: ARMS[a] for a in arms},
        "seeds": seeds,
        "epochs": args.epochs,
        "period": args.period,
        "jobs": args.jobs,
        "wall_seconds": time.perf_counter() - t0,
        "runs": runs,
    }


if __name__ == "__main__":
    raise SystemExit(main())
