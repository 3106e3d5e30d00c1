"""Run: one run directory (lock, claim, ``config.json``, metric sinks), opened by whichever
loop trains into it and closed by its :class:`~policy_probes.session.ProbeSession`:
``ProbeSession(agent, run=Run("runs/ppo", resume=True))``.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from policy_probes import plugins
from policy_probes.atomic_write import write_text_atomic
from policy_probes.processes import current_rank
from policy_probes.records import iter_jsonl, to_plain
from policy_probes.run_lock import RunDirLock, refuse_if_locked
from policy_probes.sinks import SinkGroup, SinksConfig, WandbConfig, build_sinks
from policy_probes.user_errors import mark_usage_error

log = logging.getLogger("policy_probes")

#: what a training run writes into its run_dir (overwrite removes exactly these)
RUN_OUTPUTS = (
    *("config.json", "metrics.jsonl", "metrics.jsonl.tmp", "metrics.csv", "metrics.csv.tmp"),
    *("checkpoints", "wandb", "tensorboard", "control", "report.html"),
)
#: what a run leaves behind: files, and the checkpoints directory
RUN_MARKERS = {
    "config.json": Path.is_file,
    "metrics.jsonl": Path.is_file,
    "metrics.csv": Path.is_file,
    "checkpoints": Path.is_dir,
}


class RunDirConflict(FileExistsError):
    """``run_dir`` already holds a run and neither resume nor overwrite was asked for."""

    usage_error = True


def held_outputs(run_dir: str | Path) -> list[str]:
    """The :data:`RUN_MARKERS` present in ``run_dir`` (empty: no run there)."""
    run_dir = Path(run_dir)
    return [m for m, kind in RUN_MARKERS.items() if kind(run_dir / m)]


def remove_outputs(run_dir: str | Path, names: tuple[str, ...] = RUN_OUTPUTS) -> None:
    """Delete the ``names`` entries of ``run_dir`` (default every run output: overwrite)."""
    for name in names:
        target = Path(run_dir) / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def check_run_dir_path(run_dir: str | Path) -> None:
    """Raise a usage error when ``run_dir`` has a name too long, a parent that is a file,
    or is (or lies under) a symbolic link to nothing."""
    path = Path(run_dir)
    longest = max(path.parts, key=len, default="")
    if len(longest.encode()) > NAME_MAX:
        raise mark_usage_error(
            ValueError(
                f"run_dir {_short(str(path))!r} has a name of {len(longest.encode())} bytes "
                f"({_short(longest)!r}); file systems allow {NAME_MAX}: choose a shorter "
                f"run_dir"
            )
        )
    for candidate in (path, *path.parents):
        if candidate.is_symlink() and not candidate.exists():
            raise mark_usage_error(
                FileNotFoundError(
                    f"run_dir {str(path)!r} cannot be created: {str(candidate)!r} is a "
                    f"symbolic link to {os.readlink(candidate)!r}, which does not exist; "
                    f"create its target or choose another run_dir"
                )
            )
        if candidate.exists() and not candidate.is_dir():
            raise mark_usage_error(
                NotADirectoryError(
                    f"run_dir {str(path)!r} cannot be created: {str(candidate)!r} is a file; "
                    f"choose a directory path for run_dir"
                )
            )


def check_run_dir_writable(run_dir: str | Path) -> None:
    """Raise a usage error unless a file can be created in ``run_dir`` or, while it does
    not exist, in its nearest existing parent (``/proc``, a read-only mount); an unnamed
    temporary file is the test, so nothing is left behind."""
    path = Path(run_dir)
    existing = next((p for p in (path, *path.parents) if p.is_dir()), Path.cwd())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise not_writable(path, exc) from None


def not_writable(run_dir: Path, exc: OSError) -> PermissionError:
    """The usage error of a ``run_dir`` that cannot be created or written."""
    return mark_usage_error(
        PermissionError(
            f"run_dir {str(run_dir)!r} is not writable ({exc.strerror or exc}); choose a "
            f"directory you can write to for run_dir"
        )
    )


#: the longest file name most file systems take (ext4, xfs, btrfs, tmpfs, APFS, NTFS)
NAME_MAX = 255


def _short(text: str, keep: int = 40) -> str:
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def make_run_dir(run_dir: str | Path) -> Path:
    """Create ``run_dir`` and check that it is writable (a usage error otherwise); the
    checks are :meth:`Run.check`'s (``--dry-run``), so both refuse the same paths."""
    path = Path(run_dir)
    check_run_dir_path(path)
    check_run_dir_writable(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise not_writable(path, exc) from None
    return path


def default_run_dir(name: str = "session") -> Path:
    """``runs/<name>-<time>`` (with a numeric suffix if it exists already)."""
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return path


class Run:
    """One run directory: its lock, the claim on it, ``config.json``, the metric sinks.

    ``resume``: continue the run it holds; ``overwrite``: replace it. ``config``: for
    ``config.json`` and the W&B run. ``main``: this process writes the run's files (rank 0).
    ``console``: a rich ``Console`` for the console sink. ``name``: ``runs/<name>-<time>``.
    :meth:`worker` makes the run of a worker process, which never touches the filesystem.
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
        config: dict[str, Any] | None = None,
        main: bool = True,
        console: Any = None,
        name: str = "session",
    ) -> None:
        if resume and overwrite:
            raise mark_usage_error(
                ValueError("resume and overwrite exclude each other; choose one")
            )
        self.dir = Path(run_dir) if run_dir is not None else default_run_dir(name)
        self.resume, self.overwrite, self.main = bool(resume), bool(overwrite), main
        #: whether this process reads or writes the run directory at all (False: a worker)
        self.files = True
        self.config: dict[str, Any] = dict(config or {})
        self.console = console
        #: the run's metric sinks (filled by :meth:`open_sinks` on the main process)
        self.sinks = SinkGroup()
        #: the epoch a :meth:`rewind` before the sinks opened asked for
        self._rewind: int | None = None
        self.opened = False
        self._lock = RunDirLock(self.dir)
        self._created: list[Path] = []

    @classmethod
    def worker(cls, run_dir: str | Path = "<worker>") -> Run:
        """The run of a worker process (an RLlib learner actor, a process whose records a
        driver writes): no lock, no claim, no ``config.json``, no sinks; it never reads or
        writes the filesystem, so it cannot conflict with the run the driver continues.
        ``run_dir``: the driver's directory, for messages only."""
        run = cls(run_dir, main=False)  # (a given run_dir is not looked at)
        run.files = False
        return run

    def open(self, *, claim: bool = True) -> Run:
        """Create the directory and take its lock (main process only; until :meth:`close`),
        then :meth:`claim` it unless ``claim=False``; a refusal leaves nothing behind."""
        if not self.files:  # a worker: nothing on disk
            self.opened = True
            return self
        try:
            if self.main:
                self._created = _missing_directories(self.dir)
                make_run_dir(self.dir)
                self._lock.acquire()
            if claim:
                self.claim()
        except BaseException:
            self.close(refused=True)
            raise
        self.opened = True
        return self

    def claim(self, *, dry_run: bool = False) -> None:
        """For a directory holding a run: continue it (``resume``), replace it (``overwrite``),
        restart a run killed while starting, or raise :class:`RunDirConflict`. ``dry_run``:
        remove nothing, log what would be removed."""
        held = held_outputs(self.dir) if self.files else []
        if not held or self.resume:
            return
        if not self.overwrite and not _aborted_start(self.dir, held):
            raise RunDirConflict(
                f"run_dir {str(self.dir)!r} already holds a run ({', '.join(held)}); pass "
                f"resume=True to continue it, overwrite=True to replace it (to Run, "
                f"ProbeCallback or TrainTool.invoke; command line: `policy-probes resume "
                f"{self.dir}`, `policy-probes run ... --overwrite`), or choose another run_dir"
            )
        if self.main and not dry_run:
            remove_outputs(self.dir)
        killed = "a run killed while it started; it starts again from its beginning"
        why = "overwrite" if self.overwrite else killed
        done = "would remove" if dry_run else "removed"
        log.warning("%s the previous run's %s from %s (%s)", done, ", ".join(held), self.dir, why)

    def check(self) -> None:
        """Raise what :meth:`open` would, writing nothing (``run --dry-run``)."""
        check_run_dir_path(self.dir)
        check_run_dir_writable(self.dir)
        refuse_if_locked(self.dir)
        self.claim(dry_run=True)

    def discard_records(self) -> None:
        """Delete the run's metric files (main process; a resume without a checkpoint)."""
        if self.main:
            remove_outputs(self.dir, ("metrics.jsonl", "metrics.csv", "tensorboard"))

    def last_recorded_epoch(self) -> int | None:
        """The last epoch in ``metrics.jsonl``, or ``metrics.csv`` without it (None: none)."""
        jsonl, table = self.dir / "metrics.jsonl", self.dir / "metrics.csv"
        if not self.files:
            return None
        if jsonl.is_file():
            epochs = [r["epoch"] for r in iter_jsonl(jsonl) if isinstance(r.get("epoch"), int)]
        elif table.is_file():
            with open(table, encoding="utf-8", newline="") as f:
                epochs = [int(r["epoch"]) for r in csv.DictReader(f) if r["epoch"].isdigit()]
        else:
            return None
        return max(epochs) if epochs else None

    def write_config(self) -> None:
        """Write :attr:`config` to ``config.json`` (atomically; main process only)."""
        if not self.main:
            return
        own = plugins.own_modules()
        if own:  # so that diagnose and report find their findings rules
            self.config["plugin_modules"] = own
        try:
            text = json.dumps(to_plain(self.config), indent=2)
            write_text_atomic(self.dir / "config.json", text + "\n")
        except OSError as exc:  # the sinks report an unwritable run_dir themselves
            log.error("could not write %s/config.json: %s", self.dir, exc)

    def open_sinks(
        self, sinks: SinksConfig | None = None, wandb: WandbConfig | None = None
    ) -> SinkGroup:
        """Build the metric sinks (main process only) into :attr:`sinks` and apply a
        :meth:`rewind` asked for before."""
        if self.main:
            sinks, wandb = sinks or SinksConfig(), wandb or WandbConfig()
            failures = self.sinks.failures
            for sink in build_sinks(
                self.dir, sinks, wandb, self.config, console=self.console, failures=failures
            ):
                self.sinks.add(sink)
        self.sinks.set_run_context(run_dir=self.dir, config=self.config)
        if self._rewind is not None:
            self.rewind(self._rewind)
        return self.sinks

    def rewind(self, epoch: int) -> None:
        """Drop every sink's records of epochs after ``epoch`` (a resumed loop writes them
        again), now or when the sinks open; a sink that fails is logged."""
        self._rewind = epoch
        for sink in self.sinks:
            rewind = getattr(sink, "rewind", None)
            if not callable(rewind):
                continue
            try:
                dropped = rewind(epoch)
            except Exception as exc:  # noqa: BLE001 - the sink group's isolation rule
                log.error("could not rewind metric sink %s: %s", sink.name, exc)
                continue
            if dropped:
                log.warning("%s: dropped %d records after epoch %d", sink.name, dropped, epoch)

    def choice_recorder(self) -> Callable[[dict[str, Any]], None]:
        """:func:`record_sampling_choice` of this directory (the sampler must not hold the run)."""
        if not self.files:
            return _ignore
        return functools.partial(record_sampling_choice, self.dir)

    def close(self, *, refused: bool = False) -> None:
        """Close the sinks and release the lock (idempotent); ``refused`` also removes the
        directories :meth:`open` created."""
        try:
            self.sinks.close()
        finally:
            self._lock.release()
            for directory in self._created if refused else ():  # deepest first
                with contextlib.suppress(OSError):
                    directory.rmdir()


def record_sampling_choice(run_dir: Path | None, choice: dict[str, Any]) -> None:
    """Add the probe budget's choice to ``config.json`` as ``probe_sampling`` (rank 0 only)."""
    path = None if run_dir is None else Path(run_dir) / "config.json"
    if current_rank() != 0 or path is None or not path.is_file():
        return  # rank 0 writes the run's files
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        config["probe_sampling"] = to_plain(choice)
        write_text_atomic(path, json.dumps(config, indent=2) + "\n")
    except (OSError, ValueError) as exc:  # the choice is in every record and checkpoint
        log.error("could not record the probe sampling choice in %s: %s", path, exc)


def holds_progress(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds what starting its run again would lose: an epoch record
    (``metrics.jsonl``, or a data row of ``metrics.csv``) or a checkpoints directory
    (unreadable files count as progress)."""
    run_dir = Path(run_dir)
    if (run_dir / "checkpoints").is_dir():
        return True
    jsonl, table = run_dir / "metrics.jsonl", run_dir / "metrics.csv"
    try:
        if jsonl.is_file() and any(True for _ in iter_jsonl(jsonl)):
            return True
        if table.is_file():  # a header at most: no row (lines of any length)
            with open(table, encoding="utf-8", errors="replace") as f:
                if len(list(itertools.islice(f, 2))) > 1:
                    return True
    except (OSError, ValueError):
        return True
    return False


def _ignore(_choice: dict[str, Any]) -> None:
    """A worker's sampling choice: in its records and checkpoints, not in ``config.json``."""


def _aborted_start(run_dir: Path, held: list[str]) -> bool:
    """Whether ``run_dir`` holds only what a run killed before its first step leaves
    (metric files without a record, no ``config.json``, no checkpoint)."""
    return "config.json" not in held and not holds_progress(run_dir)


def _missing_directories(run_dir: Path) -> list[Path]:
    """``run_dir`` and its parents that do not exist yet, deepest first."""
    try:
        return list(itertools.takewhile(lambda p: not p.exists(), (run_dir, *run_dir.parents)))
    except OSError:  # a name too long: make_run_dir says so
        return []
