"""What a run leaves in its run directory, and the refusal to mix two runs in one.

The built-in trainer and :class:`~policy_probes.session.ProbeSession` write the same
files (``config.json``, the metric files, ``checkpoints/``, ``wandb/`` ...). A directory
that holds any of the :data:`RUN_MARKERS` already holds a run: starting another one there
would interleave two runs' epochs in one file, so it is refused unless the caller asks to
continue the run (resume) or to replace it (overwrite).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

#: what a training run writes into its run_dir (overwrite removes exactly these)
RUN_OUTPUTS = (
    "config.json",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "metrics.csv",
    "metrics.csv.tmp",
    "checkpoints",
    "wandb",
    "tensorboard",
    "control",
    "report.html",
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

    usage_error = True  # the CLI prints it without a traceback (exit status 2)


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
    """Raise ``NotADirectoryError`` (tagged a usage error) when ``run_dir`` or one of its
    parents is a file, so the user hears about the path, not about ``mkdir``."""
    path = Path(run_dir)
    longest = max(path.parts, key=len, default="")
    if len(longest.encode()) > NAME_MAX:
        exc = ValueError(
            f"run_dir {_short(str(path))!r} has a name of {len(longest.encode())} bytes "
            f"({_short(longest)!r}); file systems allow {NAME_MAX}: choose a shorter run_dir"
        )
        exc.usage_error = True  # type: ignore[attr-defined]
        raise exc
    for candidate in (path, *path.parents):
        if candidate.exists() and not candidate.is_dir():
            exc = NotADirectoryError(
                f"run_dir {str(path)!r} cannot be created: {str(candidate)!r} is a file; "
                f"choose a directory path for run_dir"
            )
            exc.usage_error = True  # type: ignore[attr-defined]
            raise exc


#: the longest file name most file systems take (ext4, xfs, btrfs, tmpfs, APFS, NTFS)
NAME_MAX = 255


def _short(text: str, keep: int = 40) -> str:
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def make_run_dir(run_dir: str | Path) -> Path:
    """Create ``run_dir`` and check that files can be written in it; a usage error naming
    the directory otherwise."""
    path = Path(run_dir)
    check_run_dir_path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        error = PermissionError(
            f"run_dir {str(path)!r} is not writable ({exc.strerror or exc}); choose a "
            f"directory you can write to for run_dir"
        )
        error.usage_error = True  # type: ignore[attr-defined]
        raise error from None
    return path


def default_run_dir(name: str = "session") -> Path:
    """``runs/<name>-<time>`` (with a numeric suffix if it exists already)."""
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return path
