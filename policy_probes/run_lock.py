"""RunDirLock: one live run per run directory, ``run_dir/run.lock`` (pid, host, start
time, command line) created with ``O_EXCL``. A lock whose process is gone (or whose pid
now belongs to a younger process) is stale and taken over; one from another host is
refused with the path to delete.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("policy_probes")

LOCK_FILE = "run.lock"


class RunDirLocked(RuntimeError):
    """``run_dir`` is in use by a live run; the message names it."""

    usage_error = True


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``), else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (owned by any user)."""
    try:
        os.kill(pid, 0)
    except PermissionError:  # alive, owned by another user
        return True
    except OSError:  # ProcessLookupError: gone
        return False
    return True


def lock_owner(run_dir: str | Path) -> dict[str, Any] | None:
    """What ``run_dir/run.lock`` says about its holder (None: no lock or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / LOCK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lock_is_live(owner: dict[str, Any]) -> bool:
    """Whether the lock's process still runs (True on another host: it cannot be checked)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    recorded, now = owner.get("start_ticks"), _process_start_ticks(pid)
    return recorded is None or now is None or recorded == now


def describe_owner(owner: dict[str, Any]) -> str:
    started = owner.get("started")
    when = "an unknown time"
    if isinstance(started, int | float):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    command = owner.get("command") or "?"
    return f"pid {owner.get('pid')} on {owner.get('host')} since {when} ({command})"


def locked_message(run_dir: str | Path, owner: dict[str, Any]) -> str:
    """Why ``run_dir`` is refused: who holds it and what to do."""
    hint = f"if that run is gone, delete {Path(run_dir) / LOCK_FILE}"
    if owner.get("host") == socket.gethostname():
        hint = f"wait for it to finish, stop it with `policy-probes ctl {run_dir} stop`, or "
        hint += "choose another run_dir"
    return f"run_dir {str(run_dir)!r} is in use by a live run: {describe_owner(owner)}; {hint}"


def refuse_if_locked(run_dir: str | Path) -> None:
    """Raise :class:`RunDirLocked` when a live run holds ``run_dir`` (changes nothing)."""
    owner = lock_owner(run_dir)
    if owner is not None and lock_is_live(owner):
        raise RunDirLocked(locked_message(run_dir, owner))


class RunDirLock:
    """The lock on ``run_dir``: a context manager, or :meth:`acquire` / :meth:`release`."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.held = False

    def acquire(self) -> RunDirLock:
        """Take the lock, replacing a stale one (:class:`RunDirLocked` naming a live owner)."""
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "start_ticks": _process_start_ticks(os.getpid()),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300],
        }
        for _ in range(3):  # a stale lock removed between our two looks: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = lock_owner(self.run_dir)
                if owner is None:  # being written this instant, or left by a crash mid-write
                    time.sleep(0.05)
                    owner = lock_owner(self.run_dir)
                ours = owner is not None and owner.get("pid") == me["pid"]
                if ours and owner.get("host") == me["host"]:
                    raise RunDirLocked(
                        f"run_dir {str(self.run_dir)!r} is already in use by this process "
                        f"(another TrainTool.invoke or ProbeSession still open); close it first"
                    ) from None
                if owner is not None and lock_is_live(owner):
                    raise RunDirLocked(locked_message(self.run_dir, owner)) from None
                what = describe_owner(owner) if owner else "unreadable"
                log.warning("removing the stale lock %s (%s: not running)", self.path, what)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(me) + "\n")
            self.held = True
            return self
        raise RunDirLocked(f"could not take the lock {self.path}; another process keeps taking it")

    def release(self) -> None:
        """Remove the lock if this object holds it (and the file is still ours)."""
        if not self.held:
            return
        self.held = False
        owner = lock_owner(self.run_dir)
        if owner is None or owner.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
