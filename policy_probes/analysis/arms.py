"""Forked arms: a causal test of plasticity loss (Nikishin et al. 2023's diagnostic, with
exact forks; ``docs/run_control.md``).

``policy-probes arms RUN_DIR ... --epoch N --arm none --arm ...`` forks every run after
epoch ``N`` into one child per arm (``OUT/<parent>/<arm>``; a complete child is reused, an
incomplete one resumed), trains each to the parent's end and compares the arms after the
fork against the ``none`` arm (which repeats the parent bit for bit), as mean and standard
deviation over the parents: ``OUT/arms.json``, ``OUT/arms.md``, ``OUT/report-<parent>.html``."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_probes.records import METRICS_JSONL, RunRecords
from policy_probes.run_lock import describe_owner, lock_is_live, lock_owner
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
    if any(o.partition("=")[0].strip() == "seed" for o in overrides):
        raise ArmsError(
            f"--arm {text!r}: an arm is a fork, which continues its parent's random streams, "
            f"so seed= would change nothing; drop it, and compare seeds by giving one parent "
            f"run per seed"
        )
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
    """``policy-probes fork`` for a new child (or one stopped before its config.json);
    ``resume`` for one a previous call started (a child without a checkpoint forks again)."""
    cli = [sys.executable, "-m", "policy_probes.cli"]
    if (child.run_dir / "config.json").is_file():
        return [*cli, "resume", str(child.run_dir), "--no-progress"]
    fork = ["fork", str(child.parent), "--epoch", str(epoch), str(child.run_dir)]
    return [*cli, *fork, *child.arm.overrides, "--no-progress"]


#: runs a child's command once it is bound to this process: on Linux the kernel sends the
#: child SIGTERM when the arms process dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and
#: a child whose arms process is already gone does not start
_LAUNCHER = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):  # not Linux: arms' signal handlers stop the children
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(143)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class Children:
    """The children being trained: started in their own session (a terminal's Ctrl-C
    reaches arms alone), bound to this process's life, and sent the signal that stops
    arms (each checkpoints at its next minibatch boundary and exits; no orphan)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()
        #: the signal that stopped arms (None: running); no child starts after it
        self.stopped_by: int | None = None

    def run(self, command: list[str], log: Path) -> int | None:
        """Run ``command`` to its end, its output appended to ``log`` (None: not started)."""
        launcher = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *command[1:]]
        # append: an earlier attempt's lines stay, and no writer can leave a hole of NULs
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"--- policy-probes arms, {time.strftime('%Y-%m-%d %H:%M:%S')}: ")
            out.write(" ".join(shlex.quote(c) for c in command[1:]) + "\n")
            out.flush()
            with self._lock:
                if self.stopped_by is not None:
                    return None
                proc = subprocess.Popen(
                    launcher, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
                self._live.add(proc)
            try:
                return proc.wait()
            finally:
                with self._lock:
                    self._live.discard(proc)

    def stop(self, signum: int) -> None:
        """Send ``signum`` to every live child; start no other."""
        with self._lock:
            self.stopped_by = signum
            for proc in self._live:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)


class ArmsStopped(Exception):
    """arms was stopped by a signal after its children were; ``exit_code``: 128 + signal."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name}: every child was sent {name} and has stopped (a child "
            f"writes a checkpoint at its next minibatch); run the same command again to "
            f"continue them"
        )
        self.exit_code = 128 + signum


@contextlib.contextmanager
def stopping_children_on_signals(children: Children) -> Iterator[None]:
    """While training (main thread only): SIGTERM and SIGINT stop the children, then
    raise :class:`ArmsStopped` once the children have exited."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def on_signal(signum: int, frame: Any) -> None:
        if children.stopped_by is None:
            children.stop(signum)
        else:  # a second signal: at once
            children.stop(signal.SIGKILL)

    for sig in signals:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if children.stopped_by is not None:
        raise ArmsStopped(children.stopped_by)


def refuse_live_children(children: Sequence[Child]) -> None:
    """:class:`ArmsError` when a child's directory is held by a live run (an earlier arms
    stopped while a child trained, on an older version or another host)."""
    busy = []
    for child in children:
        owner = lock_owner(child.run_dir)
        if owner is not None and lock_is_live(owner):
            busy.append(f"{child.run_dir} ({describe_owner(owner)})")
    if busy:
        raise ArmsError(
            f"{len(busy)} child run(s) are still training: {'; '.join(busy)}. Wait for them "
            f"to finish or stop each with `policy-probes ctl RUN_DIR stop`, then run this "
            f"command again (finished children are reused, stopped ones resumed)"
        )


def check_children(children: Sequence[Child]) -> None:
    """Refuse before any child starts: each child to fork gets the configuration its
    ``policy-probes fork`` would build (the parent's recipe and overrides, then the arm's)
    and that fork's set-up checks (``run --dry-run``'s); an :class:`ArmsError` names the
    arm that fails. Children left by an earlier call resume their own configuration."""
    from policy_probes import runnable
    from policy_probes.overrides import apply_overrides
    from policy_probes.recipe_launch import (
        build_from_recipe,
        call_tool,
        launch_overrides,
        read_run_config,
    )
    from policy_probes.run import held_outputs
    from policy_probes.user_errors import CLIError

    recipes: dict[str, Any] = {}  # a recipe file is imported once, as one CLI call would
    for child in children:
        if held_outputs(child.run_dir):
            continue
        try:
            config, target = read_run_config(
                child.parent, "fork it with tool.invoke(fork_from=ForkPoint(run_dir, epoch))"
            )
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


def train_child(child: Child, epoch: int, end: int, children: Children) -> Child:
    from policy_probes.run import held_outputs

    if held_outputs(child.run_dir) and last_epoch(child.run_dir) >= end:
        child.returncode = 0  # complete already: reused
        return child
    child.run_dir.parent.mkdir(parents=True, exist_ok=True)
    child.returncode = children.run(child_command(child, epoch), child.log)
    if child.returncode is None:
        child.errors.append("not started: arms was stopped")
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


def check_measures(wanted: Sequence[str], keys: Sequence[str], where: str) -> None:
    """:class:`ArmsError` for a ``--measure`` that names (or ends) none of ``keys``, with
    the close matches among the keys and their endings."""
    endings = {k.split("/", i)[-1]: k for k in keys for i in range(k.count("/") + 1)}
    for w in wanted:
        if any(k == w or k.endswith(w) for k in keys):
            continue
        close = difflib.get_close_matches(w, list(endings), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(dict.fromkeys(close))}? " if close else ""
        names = sorted({k.rsplit("/", 1)[-1] for k in keys if k.startswith("probes/")})
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") or "none"
        raise ArmsError(
            f"--measure {w!r} is not a measure of {where}; {hint}a measure is a metric key "
            f"or its ending: return, return_last, or a probes/ key (endings: {shown})"
        )


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
    adds_probes = any(o.partition("=")[0].strip() == "probes" for a in arms for o in a.overrides)
    if wanted and not adds_probes:  # the children measure what the parents measured
        known = {k for p in parents for k in measures(RunRecords.read(p), epoch)}
        check_measures(wanted, sorted(known | {"return", "return_last"}), "the parent runs")
    children = [
        Child(arm, parent, out / label / arm.name, out / label / f"{arm.name}.log")
        for arm in arms
        for parent, label in zip(parents, labels, strict=True)
    ]
    refuse_live_children(children)
    check_children(children)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArmsError(f"cannot create --out {str(out)!r}: {exc.strerror or exc}") from None
    running = Children()
    with stopping_children_on_signals(running), ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(lambda c: train_child(c, epoch, end, running), children))
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
    if wanted and any(per_arm.values()):
        keys = sorted({k for by_key in comparison.values() for k in by_key})
        where = "the children (trained now: run again with a corrected --measure, they are reused)"
        check_measures(wanted, keys, where)
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
    try:
        result, children = run_arms(
            args.run_dirs, args.epoch, arms, out, args.jobs, args.measure, not args.no_report
        )
    except ArmsStopped as exc:
        print(f"policy-probes arms: {exc}", file=sys.stderr)
        return exc.exit_code
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
