"""The command channel into a running training run: the run announces itself and polls
at its minibatch boundaries; ``policy-probes ctl`` (:func:`send_command`) writes a
request and waits::

    run_dir/control/run.json                 {"pid": ..., "host": ..., "started": ...}
    run_dir/control/<id>.request             {"id": ..., "command": "pause", "sent": ...}
    run_dir/control/<id>.ack                 {"id": ..., "command": ..., "ok": true, "message": ...}

The run claims a request by renaming it (``<id>.taken``), so one withdrawn by a timed-out
``ctl`` is never half-served.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_probes.atomic_write import write_text_atomic
from policy_probes.run_lock import pid_alive

CONTROL_DIR = "control"
RUN_FILE = "run.json"
COMMANDS = ("pause", "resume", "checkpoint", "stop")


def control_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONTROL_DIR


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data) + "\n")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def announce_run(run_dir: str | Path) -> Path:
    """Create ``run_dir/control`` and record this process as the run serving it."""
    path = control_dir(run_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        path, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    )
    return path


def withdraw_run(run_dir: str | Path) -> None:
    """Remove the run's announcement (the run no longer serves the channel)."""
    path = control_dir(run_dir) / RUN_FILE
    info = _read_json(path)
    if info is not None and info.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty: unanswered requests stay visible


@dataclass(frozen=True)
class Request:
    """One claimed request: its id and command."""

    id: str
    command: str


def take_requests(run_dir: str | Path) -> list[Request]:
    """Claim every pending request, oldest first (ids start with the send time)."""
    directory = control_dir(run_dir)
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".request"))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        req_id = name.removesuffix(".request")
        taken = directory / f"{req_id}.taken"
        try:
            os.replace(directory / name, taken)  # the claim: ctl can no longer withdraw it
        except FileNotFoundError:
            continue  # withdrawn by a ctl that gave up waiting
        data = _read_json(taken) or {}
        taken.unlink(missing_ok=True)
        out.append(Request(id=req_id, command=str(data.get("command", ""))))
    return out


def acknowledge(
    run_dir: str | Path, request: Request, ok: bool, message: str, **extra: Any
) -> None:
    """Answer ``request`` (``ctl`` prints ``message``)."""
    write_json_atomic(
        control_dir(run_dir) / f"{request.id}.ack",
        {"id": request.id, "command": request.command, "ok": ok, "message": message, **extra},
    )


class ControlError(Exception):
    """The command could not be delivered (no run, run not alive); says what to do."""


def run_info(run_dir: str | Path) -> dict[str, Any]:
    """The live run's announcement (:class:`ControlError` if no run serves ``run_dir``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ControlError(f"run directory {str(run_dir)!r} does not exist")
    info = _read_json(control_dir(run_dir) / RUN_FILE)
    if info is None:
        raise ControlError(
            f"no running training run serves {str(run_dir)!r} (no {CONTROL_DIR}/{RUN_FILE}); "
            f"a finished or stopped run continues with `policy-probes resume {run_dir}`"
        )
    pid = info.get("pid")
    if info.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        raise ControlError(
            f"the run in {str(run_dir)!r} (pid {pid}) is no longer running; continue it "
            f"with `policy-probes resume {run_dir}`"
        )
    return info


def send_command(
    run_dir: str | Path, command: str, timeout: float = 30.0, poll: float = 0.05
) -> dict[str, Any] | None:
    """Send ``command`` to the run in ``run_dir`` and wait up to ``timeout`` seconds for its
    acknowledgement (``ok``, ``message``); None when none came (withdrawn if unclaimed)."""
    if command not in COMMANDS:
        raise ControlError(f"unknown command {command!r}; choose one of {', '.join(COMMANDS)}")
    run_info(run_dir)
    directory = control_dir(run_dir)
    req_id = f"{time.time_ns():020d}-{os.getpid()}"
    request = {"id": req_id, "command": command, "sent": time.time()}
    write_json_atomic(directory / f"{req_id}.request", request)
    ack_path = directory / f"{req_id}.ack"
    deadline = time.monotonic() + timeout
    while True:
        ack = _read_json(ack_path)
        if ack is not None:
            ack_path.unlink(missing_ok=True)
            return ack
        if time.monotonic() >= deadline:
            (directory / f"{req_id}.request").unlink(missing_ok=True)  # withdraw if unclaimed
            return None
        time.sleep(poll)
