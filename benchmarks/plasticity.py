"""Plasticity experiment: permuted-observation CartPole, with and without each remedy.

Every run is ``recipes.cartpole_permuted.train`` (CartPole whose 4 observation features
are permuted every ``--period`` epochs, a 64-64 ReLU actor-critic trained by PPO at a
constant lr 3e-3, ReLU activation probes on ``actor_mlp`` and ``critic_mlp``) with the
overrides of one arm, exactly as ``policy-probes run ... key=value`` would apply them:

* ``none``: no remedy;
* ``redo``: ReDo (tau 0.1) on both MLPs every 10 epochs;
* ``shrink_and_perturb``: theta <- 0.8 theta + 0.01 theta_init on both MLPs every 10 epochs;
* ``reset_layers``: the last hidden layer of both MLPs re-initialised every 40 epochs.

The same seed gives every arm the same sequence of permutations. Per run it keeps the
training episode return, the dormant fraction of each MLP (score <= 0.025, the ReLU
probe's default) and the units the remedies reset, per epoch; it writes the figure
(``--figure``: return smoothed over 10 epochs, dormant fractions; mean and +-1 std over
seeds), the results (``--results``: every run's curves) and the table in ``--doc``
between the ``plasticity:begin``/``plasticity:end`` markers, with the command line.

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

RECIPE = "recipes.cartpole_permuted.train_measured"
COMPONENTS = ("actor_mlp", "critic_mlp")
#: the plasticity measures kept per epoch (name -> POST_EPOCH key)
MEASURES: dict[str, str] = {
    "dormant_actor": "probes/relu/actor_mlp/dormant_fraction",
    "dormant_critic": "probes/relu/critic_mlp/dormant_fraction",
    "dormant_tau0.1_actor": "probes/relu/actor_mlp/dormant_fraction_tau_0.1",
    "dormant_tau0.1_critic": "probes/relu/critic_mlp/dormant_fraction_tau_0.1",
    "dead_actor": "probes/relu/actor_mlp/dead_fraction",
    "dead_critic": "probes/relu/critic_mlp/dead_fraction",
    "policy_kl": "probes/churn/actor_head/policy_kl",
    "value_change": "probes/churn/critic_head/value_change",
    "weight_norm_actor": "probes/weights/actor_mlp/norm",
    "weight_norm_critic": "probes/weights/critic_mlp/norm",
    "init_distance_actor": "probes/weights/actor_mlp/init_distance",
    "init_distance_critic": "probes/weights/critic_mlp/init_distance",
    "update_ratio_actor": "probes/weights/actor_mlp/update_ratio",
    "update_ratio_critic": "probes/weights/critic_mlp/update_ratio",
    "preact_drift_actor_l0": "probes/preactivation/actor_mlp.layer_0.linear/mean_drift",
    "preact_drift_actor_l1": "probes/preactivation/actor_mlp.layer_1.linear/mean_drift",
    "preact_drift_critic_l0": "probes/preactivation/critic_mlp.layer_0.linear/mean_drift",
    "preact_drift_critic_l1": "probes/preactivation/critic_mlp.layer_1.linear/mean_drift",
    "feature_norm_actor": "probes/preactivation/actor_mlp/feature_norm",
    "feature_norm_critic": "probes/preactivation/critic_mlp/feature_norm",
    "low_utility_actor_l0": "probes/utility/actor_mlp.layer_0/low_utility_fraction",
    "low_utility_actor_l1": "probes/utility/actor_mlp.layer_1/low_utility_fraction",
    "low_utility_critic_l0": "probes/utility/critic_mlp.layer_0/low_utility_fraction",
    "low_utility_critic_l1": "probes/utility/critic_mlp.layer_1/low_utility_fraction",
    "fisher_trace_actor": "probes/fisher/actor_mlp/trace",
    "fisher_trace_critic": "probes/fisher/critic_mlp/trace",
    "noise_scale_actor": "probes/fisher/actor_mlp/grad_noise_scale",
    "noise_scale_critic": "probes/fisher/critic_mlp/grad_noise_scale",
    "value_target_std": "train/value_target_std",
}
# (the results keep each measure as its per-period means, the curves above per epoch)
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


def run_overrides(arm: str, seed: int, epochs: int, period: int, run_dir: Path) -> list[str]:
    """The ``key=value`` overrides of one run (the batch is the recipe's 4 envs x 128 steps)."""
    batch = 4 * 128
    out = [
        f"seed={seed}",
        f"run_dir={run_dir}",
        f"trainer.total_timesteps={epochs * batch}",
        f"env.permute_obs_every={period * batch}",
        "checkpoint.every_epochs=0",
        "checkpoint.at_end=false",
        "sinks.console=false",
        "sinks.csv=false",
        "sinks.tensorboard=false",
        "wandb.mode=disabled",
    ]
    if ARMS[arm]:
        out.append(f"remedies={json.dumps(ARMS[arm])}")
    return out


def curves(run_dir: Path, epochs: int) -> dict[str, list[float]]:
    """Per-epoch return, dormant fractions and units reset (NaN: not recorded) from the
    run's POST_EPOCH records."""
    from policy_probes.records import RunRecords

    run = RunRecords.read(run_dir)

    def column(key: str) -> list[float]:
        values = run.scalars.get(key, {})
        return [float(values.get(e, math.nan)) for e in range(1, epochs + 1)]

    resets = [
        run.scalars[k]
        for k in run.scalars
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
    """Train one arm with one seed; its curves and wall time."""
    arm, seed, epochs, period, out_root = job
    import torch

    from policy_probes.cli import apply_overrides, load_recipe

    torch.set_num_threads(1)
    run_dir = Path(out_root) / f"{arm}-seed{seed}"
    tool = apply_overrides(load_recipe(RECIPE)(), run_overrides(arm, seed, epochs, period, run_dir))
    t0 = time.perf_counter()
    tool.invoke(overwrite=True)
    wall = time.perf_counter() - t0
    from policy_probes.analysis.findings import diagnose_run

    findings = [
        {
            k: f.to_dict()[k]
            for k in ("rule", "component", "metric", "onset_epoch", "value", "baseline")
        }
        for f in diagnose_run(run_dir)
    ]
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


def table(summary: dict[str, Any], arms: list[str], seeds: list[int]) -> str:
    """Markdown table: mean +- std over seeds for each arm."""
    head = "| arm | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for arm in arms:
        cells = []
        for key, _, fmt in COLUMNS:
            values = np.array([summary[f"{arm}/{s}"][key] for s in seeds])
            spread = f" ± {fmt.replace('+', '').format(values.std())}" if len(values) > 1 else ""
            cells.append(fmt.format(values.mean()) + spread)
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


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
        ("actor_mlp", "dormant fraction, actor_mlp (tau 0.025)"),
        ("critic_mlp", "dormant fraction, critic_mlp (tau 0.025)"),
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
MEASURES_BEGIN, MEASURES_END = (
    "<!-- plasticity-measures:begin -->",
    "<!-- plasticity-measures:end -->",
)
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


def correlation_table(
    runs: list[dict[str, Any]], summary: dict[str, Any], arms: list[str], period: int
) -> str:
    """One row per measure: Spearman's rho between its change (2nd half - 1st half) and
    the return change across every run (all seeds and arms), its permutation p, and the
    mean change per arm."""
    head = (
        "| measure | key | rho with return change | p | "
        + " | ".join(f"change, {a}" for a in arms)
        + " |"
    )
    rows = [head, "|" + "---|" * (4 + len(arms))]
    ret = np.array([summary[f"{r['arm']}/{r['seed']}"]["return_change"] for r in runs])
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
        rows.append(
            f"| {name} | `{key}` | {rho:+.2f} (n={int(ok.sum())}) | {p:.3f} | "
            + " | ".join(per_arm)
            + " |"
        )
    return "\n".join(rows)


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


def first_fires(run_dir: Path) -> list[dict[str, Any]]:
    """Every finding a live ``policy-probes diagnose`` would have shown during the run:
    for each rule and component, the first epoch at which diagnosing the run's records
    up to that epoch yields it, and whether it still holds at the run's end (with its
    onset then)."""
    from policy_probes.analysis.findings import FindingsEngine
    from policy_probes.records import POST_EPOCH, Record, RunRecords, iter_jsonl

    records, engine = RunRecords(), FindingsEngine()
    first: dict[tuple[str, str], int] = {}
    for line in iter_jsonl(run_dir / "metrics.jsonl"):
        if line.get("hook_point") != POST_EPOCH:
            continue
        records.add(Record.from_json(line))
        engine.update(records)  # what a diagnose of the records so far finds
        for f in engine.findings():
            first.setdefault((f.rule, f.component), line["epoch"])
    at_end = {(f.rule, f.component): f.onset_epoch for f in engine.findings()}
    return [
        {
            "rule": rule,
            "component": component,
            "first_epoch": epoch,
            "onset_at_end": at_end.get((rule, component)),
        }
        for (rule, component), epoch in first.items()
    ]


def lead_table(runs: list[dict[str, Any]], period: int, arm: str = "none") -> str:
    """Per seed of ``arm``: the epoch the return starts to fall, and for each finding at
    the run's end the epoch a live diagnose first showed it and its lead (decline epoch
    minus that epoch: positive = the finding came first)."""
    chosen = [r for r in runs if r["arm"] == arm and "first_fires" in r]
    kinds = sorted(
        {
            (f["rule"], f["component"])
            for r in chosen
            for f in r["first_fires"]
            if f["onset_at_end"] is not None
        }
    )
    head = (
        "| seed | return starts to fall | "
        + " | ".join(f"{rule} {comp}" for rule, comp in kinds)
        + " |"
    )
    if not kinds:
        return "(no finding held at the end of a run)"
    rows = [head, "|" + "---|" * (2 + len(kinds))]
    for r in chosen:
        decline = decline_epoch(r["return"], period)
        fired = {(f["rule"], f["component"]): f for f in r["first_fires"]}
        cells = []
        for kind in kinds:
            f = fired.get(kind)
            if f is None or f["onset_at_end"] is None:
                cells.append("–")
            elif decline is None:
                cells.append(f"{f['first_epoch']}")
            else:
                cells.append(f"{f['first_epoch']} ({decline - f['first_epoch']:+d})")
        rows.append(
            f"| {r['seed']} | {decline if decline is not None else 'no decline'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(rows)


def findings_table(runs: list[dict[str, Any]], arms: list[str], period: int) -> str:
    """Per rule: in how many runs of each arm it holds at the run's end, and the median
    lead over the runs whose return declines."""
    rules = sorted(
        {f["rule"] for r in runs for f in r.get("first_fires", []) if f["onset_at_end"] is not None}
    )
    head = (
        "| rule | "
        + " | ".join(f"runs, {a}" for a in arms)
        + " | median lead (epochs), runs with a decline |"
    )
    rows = [head, "|" + "---|" * (2 + len(arms))]
    for rule in rules:
        cells, leads = [], []
        for a in arms:
            mine = [r for r in runs if r["arm"] == a]
            hit = [
                r
                for r in mine
                if any(
                    f["rule"] == rule and f["onset_at_end"] is not None
                    for f in r.get("first_fires", [])
                )
            ]
            cells.append(f"{len(hit)}/{len(mine)}")
            for r in hit:
                decline = decline_epoch(r["return"], period)
                if decline is not None:
                    first = min(
                        f["first_epoch"]
                        for f in r["first_fires"]
                        if f["rule"] == rule and f["onset_at_end"] is not None
                    )
                    leads.append(decline - first)
        lead = f"{np.median(leads):+.0f} (n={len(leads)})" if leads else "–"
        rows.append(f"| {rule} | " + " | ".join(cells) + f" | {lead} |")
    return "\n".join(rows)


def measures_block(
    runs: list[dict[str, Any]], summary: dict[str, Any], arms: list[str], period: int
) -> str:
    """The doc section on the plasticity measures: correlations, findings, lead times."""
    declines = {f"{r['arm']}/{r['seed']}": decline_epoch(r["return"], period) for r in runs}
    parts = []
    for r in runs:
        if r["arm"] == "none":
            epoch = declines["none/" + str(r["seed"])]
            parts.append(f"seed {r['seed']}: {epoch if epoch is not None else 'none'}")
    none_declines = ", ".join(parts)
    return (
        "Rank correlation (Spearman) across all runs (seeds x arms) between each measure's "
        "change (mean over periods 7-12 minus mean over periods 1-6) and the return change "
        f"(the same halves, %); p from {PERMUTATIONS} permutations:\n\n"
        f"{correlation_table(runs, summary, arms, period)}\n\n"
        "Findings (`policy-probes diagnose`) that hold at the end of the run, per arm, and "
        "their median lead over the return's decline (decline epoch minus the epoch a live "
        "`diagnose` first showed the finding; positive: the finding came first):\n\n"
        f"{findings_table(runs, arms, period)}\n\n"
        f"Per seed without a remedy (return decline epochs: {none_declines}); each cell: the "
        "epoch a live `diagnose` first showed the finding (its lead in epochs):\n\n"
        f"{lead_table(runs, period)}"
    )


def period_table(
    runs: list[dict[str, Any]], arms: list[str], key: str, period: int, fmt: str
) -> str:
    """Markdown table: one row per arm, one column per period, the mean over seeds of
    ``key``'s per-period mean."""
    n = len(runs[0][key]) // period
    rows = ["| arm | " + " | ".join(str(k + 1) for k in range(n)) + " |"]
    rows.append("|" + "---|" * (n + 1))
    for arm in arms:
        means = np.vstack([period_means(r[key], period) for r in runs if r["arm"] == arm])
        with np.errstate(all="ignore"):
            rows.append(
                f"| {arm} | " + " | ".join(fmt.format(v) for v in np.nanmean(means, 0)) + " |"
            )
    return "\n".join(rows)


def load_results(path: Path) -> dict[str, Any]:
    """A results file written by :func:`main`, null values back to NaN."""
    data = json.loads(path.read_text())
    data["runs"] = [
        {
            k: [math.nan if x is None else x for x in v] if isinstance(v, list) else v
            for k, v in r.items()
        }
        for r in data["runs"]
    ]
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--epochs", type=int, default=480, help="epochs per run (512 steps each)")
    p.add_argument("--period", type=int, default=40, help="epochs between permutations")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (one core each)")
    p.add_argument("--out", default="runs/plasticity", help="run directories go here")
    p.add_argument("--results", default="benchmarks/results/plasticity.json")
    p.add_argument("--figure", default="docs/figures/plasticity.png")
    p.add_argument("--doc", default="docs/plasticity.md")
    p.add_argument(
        "--from-results",
        action="store_true",
        help="train nothing: redraw the figure and tables from the --results file",
    )
    args = p.parse_args(argv)
    results = Path(args.results)
    data = load_results(results) if args.from_results else train_arms(p, args, argv)
    runs, arms, seeds, period = data["runs"], list(data["arms"]), data["seeds"], data["period"]
    summary = summarize(runs, period)
    for r in runs:  # what a live diagnose showed, from the run's records when they are here
        metrics = Path(r["run_dir"]) / "metrics.jsonl"
        if "first_fires" not in r and metrics.is_file():
            r["first_fires"] = first_fires(Path(r["run_dir"]))
        # the measures are kept as per-period means (their per-epoch values stay in the
        # run's metrics.jsonl): 20 runs x 29 measures x 480 epochs would be megabytes
        for name in MEASURES:
            if name in r and len(r[name]) == data["epochs"]:
                r[name] = [float(v) for v in period_means(r[name], period)]
    # (--from-results rewrites the same runs with the summary this version computes)
    results.parent.mkdir(parents=True, exist_ok=True)
    plain_summary = {k: plain(v) for k, v in summary.items()}
    plain_runs = [plain(r) for r in runs]
    results.write_text(json.dumps({**data, "summary": plain_summary, "runs": plain_runs}) + "\n")
    figure(runs, arms, period, Path(args.figure))
    md = table(summary, arms, seeds)
    block = (
        f"Reproduce: `nice {data['command']}` ({len(runs)} runs, "
        f"{data['wall_seconds'] / 60:.1f} min wall with --jobs {data['jobs']}). "
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))}), {data['epochs']} epochs of 512 "
        f"agent steps, a new permutation every {period} epochs; mean ± std over seeds.\n\n"
        f"{md}\n\n![plasticity]({os.path.relpath(args.figure, Path(args.doc).parent)})\n\n"
        f"Training episode return per period (mean over seeds):\n\n"
        f"{period_table(runs, arms, 'return', period, '{:.0f}')}\n\n"
        f"Dormant fraction of actor_mlp per period (mean over seeds):\n\n"
        f"{period_table(runs, arms, 'actor_mlp', period, '{:.2f}')}\n\n"
        f"Dormant fraction of critic_mlp per period (mean over seeds):\n\n"
        f"{period_table(runs, arms, 'critic_mlp', period, '{:.2f}')}"
    )
    write_doc(Path(args.doc), block)
    doc = Path(args.doc)
    if MEASURES_BEGIN in doc.read_text() and any(name in r for r in runs for name in MEASURES):
        # only into a doc that has the section's markers (docs/plasticity.md does)
        write_doc(doc, measures_block(runs, summary, arms, period), MEASURES_BEGIN, MEASURES_END)
    print(md)
    print(f"figure: {args.figure}; tables: {args.doc}; results: {results}")
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
    given = sys.argv[1:] if argv is None else argv
    return {
        "command": "python -m benchmarks.plasticity " + shlex.join(given),
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
