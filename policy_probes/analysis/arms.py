"""Forked arms: a causal test of plasticity loss (Nikishin et al. 2023's diagnostic, with
exact forks; ``docs/run_control.md``).

``policy-probes arms RUN_DIR ... --epoch N --arm none --arm ...`` forks every run after
epoch ``N`` into one child per arm (``OUT/<parent>/<arm>``; a complete child is reused, an
incomplete one resumed), trains each to the parent's end and compares the arms after the
fork against the ``none`` arm (which repeats the parent bit for bit), as mean and standard
deviation over the parents: ``OUT/arms.json``, ``OUT/arms.md``, ``OUT/report-<parent>.html``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_probes.records import METRICS_JSONL, RunRecords
from policy_probes.user_errors import positive_int

#: the training return the comparison leads with
RETURN_KEY = "rollout/episode_return"
#: the arm without a change, the reference of the differences
NONE = "none"
_NAMED = re.compile(r"^(?P<name>[A-Za-z0-9_.+-]+):(?P<rest>.*)$", re.S)
#: where one override of an arm ends: whitespace before the next ``key=``
_NEXT_OVERRIDE = re.compile(r"\s+(?=[A-Za-z_][\w.]*=)")


class ArmsError(ValueError):
    """Bad arguments; the message says what to change."""

    usage_error = True


@dataclass
class Arm:
    """One arm: a name and the overrides its children get."""

    name: str
    overrides: list[str]


def parse_arm(text: str) -> Arm:
    """``"none"`` or ``"[NAME:]key=value [key=value ...]"`` (an override ends at whitespace
    before the next ``key=``; values are taken as written, quotes and all)."""
    text = text.strip()
    if text == NONE:
        return Arm(NONE, [])
    m = _NAMED.match(text)
    name, rest = (m["name"], m["rest"]) if m else (None, text)
    overrides = [o for o in _NEXT_OVERRIDE.split(rest.strip()) if o]
    bad = [o for o in overrides if "=" not in o]
    if not overrides or bad:
        raise ArmsError(
            f"--arm {text!r}: an arm is 'none' or '[NAME:]key=value [key=value ...]', e.g. "
            f"--arm 'remedies=[\"l2_init@actor_mlp:coef=0.001\"]'"
            + (f"; {bad[0]!r} is not key=value" if bad else "")
        )
    if name == NONE:
        raise ArmsError(f"--arm {text!r}: the name 'none' is the arm without overrides")
    return Arm(name or default_name(overrides), overrides)


def default_name(overrides: Sequence[str]) -> str:
    """The remedies' names joined by ``+`` for a ``remedies=`` arm, else the overrides."""
    names: list[str] = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "remedies":
            names += re.findall(r"([A-Za-z0-9_]+)@", value)
        else:
            names.append(re.sub(r"[^A-Za-z0-9_.+-]+", "_", item).strip("_"))
    return "+".join(dict.fromkeys(names)) or "arm"  # one remedy on two components: once


def unique_arms(arms: Sequence[Arm]) -> list[Arm]:
    seen: dict[str, int] = {}
    out = []
    for arm in arms:
        seen[arm.name] = seen.get(arm.name, 0) + 1
        name = arm.name if seen[arm.name] == 1 else f"{arm.name}-{seen[arm.name]}"
        out.append(Arm(name, arm.overrides))
    return out


def last_epoch(run_dir: Path) -> int:
    """The last epoch of a run's records (0: none)."""
    return RunRecords.read(run_dir).last_epoch or 0


def measures(records: RunRecords, after: int) -> dict[str, float]:
    """Means over the epochs after ``after``: the return, the return of the last quarter
    of those epochs and every probe metric (epochs without a finite value are left out)."""
    epochs = [e for e in records.epochs if e > after]
    if not epochs:
        return {}
    last = epochs[-max(1, math.ceil(len(epochs) / 4)) :]
    out: dict[str, float] = {}

    def mean(key: str, which: Sequence[int]) -> float | None:
        series = records.scalars.get(key, {})
        values = [float(v) for e in which if math.isfinite(v := series.get(e, math.nan))]
        return sum(values) / len(values) if values else None

    wanted = [("return", RETURN_KEY, epochs), ("return_last", RETURN_KEY, last)]
    wanted += [(k, k, epochs) for k in sorted(records.scalars) if k.startswith("probes/")]
    for name, key, which in wanted:
        value = mean(key, which)
        if value is not None:
            out[name] = value
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    n = len(values)
    mu = sum(values) / n
    sd = math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mu, sd


def compare(
    per_arm: dict[str, dict[str, dict[str, float]]], parents: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{arm: {measure: {per_parent, mean, std, diff_per_parent, diff_mean, diff_std}}}``:
    the differences pair each child with the ``none`` child of the same parent."""
    base = per_arm.get(NONE, {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, by_parent in per_arm.items():
        keys = sorted({k for p in parents for k in by_parent.get(p, {})})
        out[arm] = {}
        for key in keys:
            have = [p for p in parents if key in by_parent.get(p, {})]
            values = [by_parent[p][key] for p in have]
            entry: dict[str, Any] = {"per_parent": dict(zip(have, values, strict=True))}
            entry["mean"], entry["std"] = mean_std(values)
            paired = [p for p in have if key in base.get(p, {})]
            if paired and NONE in per_arm:
                diffs = [by_parent[p][key] - base[p][key] for p in paired]
                entry["diff_per_parent"] = dict(zip(paired, diffs, strict=True))
                entry["diff_mean"], entry["diff_std"] = mean_std(diffs)
            out[arm][key] = entry
    return out


@dataclass
class Child:
    arm: Arm
    parent: Path
    run_dir: Path
    log: Path
    returncode: int | None = None
    errors: list[str] = field(default_factory=list)


def child_command(child: Child, epoch: int) -> list[str]:
    """``policy-probes fork`` for a new child; ``resume`` for one a previous call left."""
    from policy_probes.run import held_outputs  # imports torch: not for `--help`

    cli = [sys.executable, "-m", "policy_probes.cli"]
    if held_outputs(child.run_dir):
        return [*cli, "resume", str(child.run_dir), "--no-progress"]
    fork = ["fork", str(child.parent), "--epoch", str(epoch), str(child.run_dir)]
    return [*cli, *fork, *child.arm.overrides, "--no-progress"]


def check_children(children: Sequence[Child]) -> None:
    """Refuse before any child starts: each child to fork gets the configuration its
    ``policy-probes fork`` would build (the parent's recipe and overrides, then the arm's)
    and that fork's set-up checks (``run --dry-run``'s); an :class:`ArmsError` names the
    arm that fails. Children left by an earlier call resume their own configuration."""
    from policy_probes import runnable
    from policy_probes.cli import build_from_recipe, call_tool, launch_overrides, read_run_config
    from policy_probes.overrides import apply_overrides
    from policy_probes.run import held_outputs
    from policy_probes.user_errors import CLIError

    recipes: dict[str, Any] = {}  # a recipe file is imported once, as one CLI call would
    for child in children:
        if held_outputs(child.run_dir):
            continue
        try:
            config, target = read_run_config(child.parent, "fork it from Python")
            if target not in recipes:
                recipes[target] = build_from_recipe(target)
            overrides = launch_overrides(config, child.arm.overrides, child.run_dir)
            tool = apply_overrides(recipes[target], overrides)
            if not runnable.supports_fork(tool):
                raise CLIError(f"{type(tool).__name__}.invoke() takes no fork_from keyword")
            call_tool(tool.check_setup, overwrite=True)  # reads only
        except CLIError as exc:
            arm = child.arm
            what = f"{arm.name!r} ({' '.join(arm.overrides)})" if arm.overrides else repr(arm.name)
            raise ArmsError(
                f"arm {what} cannot fork {child.parent}: {exc}; no child was started"
            ) from exc


def train_child(child: Child, epoch: int, end: int) -> Child:
    from policy_probes.run import held_outputs

    if held_outputs(child.run_dir) and last_epoch(child.run_dir) >= end:
        child.returncode = 0  # complete already: reused
        return child
    child.run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(child.log, "w") as log:
        proc = subprocess.run(
            child_command(child, epoch), stdout=log, stderr=subprocess.STDOUT, env=os.environ
        )
    child.returncode = proc.returncode
    return child


def parent_labels(parents: Sequence[Path]) -> list[str]:
    """Directory names of the parents, numbered where two share one."""
    names = [p.resolve().name for p in parents]
    if len(set(names)) == len(names):
        return names
    return [f"{i}-{n}" for i, n in enumerate(names)]


def _fmt(entry: dict[str, Any] | None, diff: bool = False) -> str:
    prefix = "diff_" if diff else ""
    if entry is None or f"{prefix}mean" not in entry:
        return "-"
    mu, sd, n = entry[f"{prefix}mean"], entry[f"{prefix}std"], len(entry[f"{prefix}per_parent"])
    sign = "+" if diff else ""
    return f"{mu:{sign}.4g}" + (f" ± {sd:.2g}" if n > 1 else "")


#: the width of the printed table when stdout is not a terminal
TABLE_WIDTH = 120
#: the columns of :func:`table_rows`
TABLE_HEADER = ("arm", "measure", "runs", "mean ± std", "Δ vs none")


def table_rows(
    comparison: dict[str, dict[str, dict[str, Any]]], shown: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """One row per measure and arm, the measures in ``shown``'s order (a long table:
    five columns however many measures, so it fits a terminal)."""
    rows = []
    for key in shown:
        for arm, by_key in comparison.items():
            entry = by_key.get(key)
            runs = len(entry["per_parent"]) if entry else 0
            rows.append([arm, key, str(runs), _fmt(entry), _fmt(entry, diff=True)])
    return list(TABLE_HEADER), rows


def shown_measures(comparison: dict[str, dict[str, Any]], wanted: Sequence[str]) -> list[str]:
    """``return``, ``return_last``, then the ``--measure`` keys (default: at most four
    ``dormant_fraction`` of whole components)."""
    keys = sorted({k for by_key in comparison.values() for k in by_key})
    if wanted:
        chosen = [k for k in keys if any(k == w or k.endswith(w) for w in wanted)]
    else:
        chosen = [
            k
            for k in keys
            if k.endswith("/dormant_fraction") and k.count("/") == 3 and "." not in k.split("/")[2]
        ][:4]
    return [k for k in ("return", "return_last") if k in keys] + chosen


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_arms(
    parents: Sequence[Path],
    epoch: int,
    arms: Sequence[Arm],
    out: Path,
    jobs: int = 1,
    wanted: Sequence[str] = (),
    report: bool = True,
) -> tuple[dict[str, Any], list[Child]]:
    """Fork, train and compare; returns what ``out/arms.json`` holds and the children."""
    parents = [Path(p) for p in parents]
    for parent in parents:
        if not (parent / "config.json").is_file() or not (parent / METRICS_JSONL).is_file():
            raise ArmsError(
                f"{str(parent)!r} is not a finished run directory (config.json and "
                f"{METRICS_JSONL}); give runs started with `policy-probes run`"
            )
    ends = {p: last_epoch(p) for p in parents}
    if len(set(ends.values())) != 1:
        raise ArmsError(f"the parents end at different epochs ({ends}); compare runs of one length")
    end = next(iter(ends.values()))
    if not 1 <= epoch < end:
        raise ArmsError(f"--epoch must be in 1 .. {end - 1} (the parents end at epoch {end})")
    labels = parent_labels(parents)
    if out.exists() and not out.is_dir():
        raise ArmsError(f"--out {str(out)!r} is a file; give a directory for the arms' runs")
    children = [
        Child(arm, parent, out / label / arm.name, out / label / f"{arm.name}.log")
        for arm in arms
        for parent, label in zip(parents, labels, strict=True)
    ]
    check_children(children)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArmsError(f"cannot create --out {str(out)!r}: {exc.strerror or exc}") from None
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(lambda c: train_child(c, epoch, end), children))
    per_arm: dict[str, dict[str, dict[str, float]]] = {a.name: {} for a in arms}
    for child in done:
        records = RunRecords.read(child.run_dir) if child.returncode == 0 else None
        if records is None or (records.last_epoch or 0) < end:
            child.errors.append(
                f"training failed (exit status {child.returncode}; see {child.log})"
            )
        elif records.epochs[0] != epoch + 1:
            child.errors.append(f"its records start at epoch {records.epochs[0]}, not {epoch + 1}")
        else:
            per_arm[child.arm.name][child.run_dir.parent.name] = measures(records, epoch)
    comparison = compare(per_arm, labels)
    result = {
        "parents": {label: str(p) for label, p in zip(labels, parents, strict=True)},
        "epoch": epoch,
        "end": end,
        "arms": {a.name: {"overrides": a.overrides} for a in arms},
        "children": {
            f"{c.arm.name}/{c.run_dir.parent.name}": {"run_dir": str(c.run_dir), "errors": c.errors}
            for c in done
        },
        "comparison": comparison,
    }
    (out / "arms.json").write_text(json.dumps(result, indent=2) + "\n")
    header, rows = table_rows(comparison, shown_measures(comparison, wanted))
    intro = (
        f"Forked at epoch {epoch} of {end}; means over epochs {epoch + 1}-{end} (return_last: "
        f"the last quarter of them); mean ± std over {len(parents)} parent run(s); Δ: the arm "
        f"minus the `none` child of the same parent.\n\n"
    )
    (out / "arms.md").write_text(intro + markdown(header, rows))
    if report:
        write_reports(out, arms, labels, children)
    return result, done


def write_reports(out: Path, arms: Sequence[Arm], labels: Sequence[str], children: list[Child]):
    """One report per parent: the ``none`` child (else the first) with the others overlaid."""
    from policy_probes.analysis.report import build_report

    order = [a.name for a in sorted(arms, key=lambda a: a.name != NONE)]
    for label in labels:
        mine = [c for c in children if c.run_dir.parent.name == label and c.arm.name in order]
        mine.sort(key=lambda c: order.index(c.arm.name))
        dirs = [c.run_dir for c in mine if (c.run_dir / METRICS_JSONL).is_file()]
        if dirs:
            build_report(dirs[0], out / f"report-{label}.html", compare=dirs[1:])


def add_arms_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "arms",
        help="fork runs at an epoch into one child per arm and compare the arms",
        description="Fork every RUN_DIR at the end of epoch N into one child per --arm "
        "(OUT/<run>/<arm>), train each to the parent's end, and compare the arms after the "
        "fork: mean return, return of the last quarter and probe metrics, with the "
        "difference to the `none` arm (mean ± std over the RUN_DIRs). Writes OUT/arms.json, "
        "OUT/arms.md and OUT/report-<run>.html; the parents are only read "
        "(docs/run_control.md).",
        epilog="example:\n  policy-probes arms runs/perm-1 runs/perm-2 --epoch 240 --arm none "
        '\\\n    --arm \'remedies=["l2_init@actor_mlp:coef=0.001","l2_init@critic_mlp:coef=0.001"]\' '
        "\\\n    --arm 'ln:policy.layer_norm=true' --jobs 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="parent run(s)")
    p.add_argument("--epoch", type=positive_int, required=True, help="fork after this epoch")
    p.add_argument(
        "--arm",
        action="append",
        required=True,
        help="'none' or '[NAME:]key=value [key=value ...]' (repeat for each arm)",
    )
    p.add_argument("--jobs", type=positive_int, default=1, help="children trained at once")
    p.add_argument("--out", type=Path, default=None, help="default: RUN_DIR-arms-e<N>")
    p.add_argument(
        "--measure",
        action="append",
        default=[],
        help="a metric key (or its ending) to show in the table besides the return",
    )
    p.add_argument("--no-report", action="store_true", help="skip the HTML reports")
    p.set_defaults(handler=arms_command)


def arms_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    arms = unique_arms([parse_arm(a) for a in args.arm])
    first = args.run_dirs[0]
    out = args.out or first.parent / f"{first.resolve().name}-arms-e{args.epoch}"
    result, children = run_arms(
        args.run_dirs, args.epoch, arms, out, args.jobs, args.measure, not args.no_report
    )
    comparison = result["comparison"]
    header, rows = table_rows(comparison, shown_measures(comparison, args.measure))
    table = Table(title=f"arms forked at epoch {result['epoch']} of {result['end']}")
    for col in header:  # names fold onto a second line; numbers stay whole
        numeric = col not in ("arm", "measure")
        table.add_column(
            col, overflow="fold", no_wrap=numeric, justify="right" if numeric else "left"
        )
    for i, row in enumerate(rows):
        if i and row[1] != rows[i - 1][1]:
            table.add_section()  # one block per measure
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=TABLE_WIDTH)  # a log: as wide as a wide terminal
    console.print(table)
    console.print(f"comparison: {out / 'arms.json'}, {out / 'arms.md'}", soft_wrap=True)
    failed = [c for c in children if c.errors]
    for c in failed:
        console.print(f"[red]{c.arm.name} from {c.parent}: {'; '.join(c.errors)}[/red]")
    return 1 if failed else 0
