"""Run control: a clean stop on SIGINT/SIGTERM and the ``policy-probes ctl`` command channel
(``docs/run_control.md``).

:class:`RunControl` is a trainer hook that acts at *minibatch boundaries* (after each
optimizer step) and at epoch ends. A signal only sets a flag; at the next boundary the run
writes a (mid-epoch) checkpoint, flushes every sink and raises :class:`RunStopped` (exit
status 130 for SIGINT, 143 for SIGTERM); a second signal stops at once. Commands
(:mod:`policy_probes.control_channel`): ``checkpoint``, ``pause`` (until ``resume``,
serving ``checkpoint`` and ``stop`` meanwhile), ``stop`` (exit status 0). In a distributed
run every rank runs this hook; each boundary's decision (the highest signal of any rank,
rank 0's command) is all-reduced over a gloo group, and rank 0 writes the checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from policy_probes.control_channel import (
    COMMANDS,
    Request,
    acknowledge,
    announce_run,
    take_requests,
    withdraw_run,
)
from policy_probes.lifecycle.manager import current_rank
from policy_probes.run import Run
from policy_probes.sinks import SinkGroup
from trainers.callbacks import TrainerHook, TrainerState
from trainers.checkpoint import (
    CheckpointError,
    CheckpointHook,
    completed_epochs,
    list_checkpoints,
    load_checkpoint,
    newest_valid_checkpoint,
    remove_stale_temp_files,
    restore_trainer,
)

log = logging.getLogger("trainers")

#: exit status of a run stopped by a signal (128 + the signal number, the shell convention)
SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: exit status of a run stopped by ``policy-probes ctl RUN_DIR stop``
CTL_STOP_EXIT_CODE = 0


class RunStopped(BaseException):
    """Training stopped on request (signal or ``ctl stop``) after writing a checkpoint; a
    ``BaseException`` like ``KeyboardInterrupt`` (not an error for ``except Exception`` to
    swallow). ``exit_code`` is what the CLI exits with."""

    def __init__(self, message: str, exit_code: int, checkpoint: Path | None, epoch: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint
        self.epoch = epoch


class RunControl(TrainerHook):
    """Serves signals and ``ctl`` commands (``run_dir/control/``) at minibatch boundaries.
    ``poll_interval``: seconds between looks at the channel while training (signals are
    checked at every boundary); ``max_pause_poll``: longest sleep between looks while paused.
    """

    critical = True  # RunStopped must leave the loop; other errors are bugs worth seeing
    run_on_all_ranks = True

    def __init__(
        self,
        run_dir: str | Path,
        checkpointer: CheckpointHook,
        sinks: SinkGroup | None = None,
        *,
        poll_interval: float = 0.05,
        max_pause_poll: float = 0.25,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.checkpointer = checkpointer
        self.sinks = sinks
        self.poll_interval = poll_interval
        self.max_pause_poll = max_pause_poll
        #: the first stop signal received (None: none)
        self.signal: int | None = None
        self._pending: collections.deque[Request] = collections.deque()
        self._next_poll = 0.0
        self._previous_handlers: dict[int, Any] = {}
        self._group: Any = None
        self._distributed = False

    # ------------------------------------------------------------------ signals
    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[RunControl]:
        """Install the SIGINT/SIGTERM handlers for the ``with`` block (main thread only;
        elsewhere only ``ctl`` works)."""
        main = threading.current_thread() is threading.main_thread()
        if main:
            for sig in SIGNAL_EXIT_CODES:
                self._previous_handlers[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)
        try:
            yield self
        finally:
            if main:
                self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:  # the second one: do not wait for the boundary
            os.write(2, f"\n{name} again: stopping immediately, no checkpoint\n".encode())
            self._restore_handlers()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.signal = signum
        # os.write: logging is not safe inside a signal handler
        os.write(
            2,
            f"\n{name}: finishing the current minibatch, then checkpoint and stop "
            f"(send it again to stop at once)\n".encode(),
        )

    # ------------------------------------------------------------------ trainer hook
    def on_new_training_run(self, state: TrainerState) -> None:
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            # decisions travel over gloo (CPU), never as a GPU sync
            gloo = dist.get_backend() == "gloo"
            self._group = None if gloo else dist.new_group(backend="gloo")
        if current_rank() == 0:
            announce_run(self.run_dir)

    def on_mb_end(self, state: TrainerState) -> None:
        if not self._distributed and self.signal is None:
            now = time.monotonic()
            if now < self._next_poll:
                return
            self._next_poll = now + self.poll_interval
        self.serve(state)

    def on_epoch_end(self, state: TrainerState) -> None:
        self.serve(state)

    def on_training_end(self, state: TrainerState) -> None:
        if current_rank() == 0:
            withdraw_run(self.run_dir)

    # ------------------------------------------------------------------ serving
    def _next_request(self, state: TrainerState) -> Request | None:
        """This boundary's request or None, the same on every rank; a pending signal (on
        any rank) stops the run here."""
        if current_rank() == 0:
            self._pending.extend(take_requests(self.run_dir))
        request = self._pending.popleft() if self._pending else None
        signum = self.signal or 0
        if self._distributed:
            known = request is not None and request.command in COMMANDS
            code = COMMANDS.index(request.command) + 1 if known else 0
            decision = torch.tensor([signum, code], dtype=torch.int64)
            dist.all_reduce(decision, op=dist.ReduceOp.MAX, group=self._group)
            signum, code = (int(v) for v in decision.tolist())
            if request is None and code:
                request = Request(id="", command=COMMANDS[code - 1])  # another rank's view
        if signum:
            self.stop(state, signal.Signals(signum).name, SIGNAL_EXIT_CODES[signum])
        return request

    def serve(self, state: TrainerState) -> None:
        """Act on a pending signal and on every pending command."""
        while (request := self._next_request(state)) is not None:
            self._handle(state, request)

    def _handle(self, state: TrainerState, request: Request) -> None:
        where = self._where(state)
        if request.command == "checkpoint":
            path, error = self._save(state)
            if error is None:
                self._ack(
                    request, True, f"checkpoint written {where}: {path}", checkpoint=str(path)
                )
            else:
                self._ack(request, False, f"checkpoint failed {where}: {error}")
        elif request.command == "pause":
            resume = f"`policy-probes ctl {self.run_dir} resume` continues"
            self._ack(request, True, f"paused {where}; {resume}")
            self._pause(state)
        elif request.command == "resume":
            self._ack(request, True, f"the run is not paused ({where})")
        elif request.command == "stop":
            self.stop(state, "`policy-probes ctl stop`", CTL_STOP_EXIT_CODE, request)
        else:
            self._ack(request, False, f"unknown command {request.command!r}; use {COMMANDS}")

    def _pause(self, state: TrainerState) -> None:
        """Wait until ``resume`` (or stop), sleeping with exponential backoff."""
        t0 = time.monotonic()
        delay = 0.01
        log.warning("paused at epoch %d, optimizer step %d", state.epoch, state.optimizer_step)
        try:
            while True:
                if current_rank() == 0:
                    time.sleep(delay)  # the other ranks wait inside the all-reduce
                delay = min(2 * delay, self.max_pause_poll)
                request = self._next_request(state)
                if request is None:
                    continue
                delay = 0.01
                if request.command == "resume":
                    self._ack(request, True, f"resumed {self._where(state)}")
                    return
                if request.command == "pause":
                    self._ack(request, True, f"already paused {self._where(state)}")
                else:
                    self._handle(state, request)
        finally:
            # time spent paused is not training time (perf/sps stays meaningful)
            state.trainer.exclude_from_clock(time.monotonic() - t0)
            log.warning("resumed after %.1f s", time.monotonic() - t0)

    def stop(
        self, state: TrainerState, reason: str, exit_code: int, request: Request | None = None
    ) -> None:
        """Checkpoint, flush the sinks and raise :class:`RunStopped`."""
        path, error = self._save(state)
        if self.sinks is not None:
            self.sinks.set_run_context(ended=f"stopped by {reason}")  # the last table's title
            self.sinks.flush()
        where = self._where(state)
        if error is None:
            written = path if path is not None else "written by rank 0"
            message = (
                f"stopped by {reason} {where}; checkpoint {written}; continue with "
                f"`policy-probes resume {self.run_dir}`"
            )
        else:
            message = f"stopped by {reason} {where}; the checkpoint could not be written: {error}"
        if request is not None:
            self._ack(request, error is None, message, checkpoint=str(path) if path else None)
        # said once, by whoever catches it (the CLI prints it; RunStopped carries it)
        raise RunStopped(message, exit_code, path, state.epoch)

    # ------------------------------------------------------------------ helpers
    def _save(self, state: TrainerState) -> tuple[Path | None, str | None]:
        """Write a checkpoint on rank 0 (reusing this epoch's if it was just written)."""
        if current_rank() != 0:
            return None, None
        if state.trainer.update_progress is None and self.checkpointer.saved_epoch == state.epoch:
            return state.last_checkpoint, None
        try:
            return self.checkpointer.save(state), None
        except Exception as exc:  # noqa: BLE001 - reported to the user, the run decides
            log.exception("checkpoint failed at epoch %d", state.epoch)
            return None, f"{type(exc).__name__}: {exc}"

    def _ack(self, request: Request, ok: bool, message: str, **extra: Any) -> None:
        if current_rank() == 0 and request.id:
            try:
                acknowledge(self.run_dir, request, ok, message, **extra)
            except OSError as exc:
                log.error("could not acknowledge %s: %s", request.command, exc)

    @staticmethod
    def _where(state: TrainerState) -> str:
        p = state.trainer.update_progress
        if p is None:
            return f"at the end of epoch {state.epoch} (optimizer step {state.optimizer_step})"
        return (
            f"in epoch {state.epoch}, update epoch {p.update_epoch}, after minibatch "
            f"{p.next_minibatch} (optimizer step {state.optimizer_step})"
        )


# ---------------------------------------------------------------------- resuming
def select_checkpoint(run: Run, resume: bool | str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a resumed run starts from (None: no resume, or none yet).
    ``resume=True``: the newest that loads (an unreadable one is reported and the previous
    one used; a run that died before its first checkpoint drops its records and starts
    again); ``resume=PATH``: that checkpoint."""
    if not resume:
        return None
    directory = run.dir / "checkpoints"
    if run.main and directory.is_dir():
        remove_stale_temp_files(directory)
    if resume is True:
        if not list_checkpoints(directory):
            last = run.last_recorded_epoch()
            dropped = f"its records of epochs 1-{last} are dropped and " if last else ""
            log.warning(
                "no checkpoint in %s: nothing to resume from; %sthe run trains again from its "
                "beginning (a fork: from its parent's checkpoint)",
                directory,
                dropped,
            )
            run.discard_records()
            return None
        try:
            return newest_valid_checkpoint(directory)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot resume {run.dir}: {exc}") from None
    path = Path(resume)
    if not path.is_file():
        available = [str(p) for p in list_checkpoints(directory)]
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist; give one of "
            f"{available or 'none: this run has no checkpoints'} (or drop --checkpoint to "
            f"use the newest valid one)"
        )
    return path, load_checkpoint(path)


def refuse_finished_without_checkpoint(run: Run, num_epochs: int) -> None:
    """Raise ``ValueError`` when a resume finds a run whose records reach its last epoch
    (``num_epochs``) but no checkpoint: nothing to resume from, and training it again
    would only replace what it recorded."""
    if list_checkpoints(run.dir / "checkpoints"):
        return
    last = run.last_recorded_epoch()
    if last is None or last < num_epochs:
        return
    raise ValueError(
        f"{run.dir} finished its {last} epochs and holds no checkpoint (it ran with "
        f"checkpoint.at_end=false, or they were deleted): there is nothing to resume "
        f"from. To train it again from its beginning: `policy-probes run RECIPE "
        f"run_dir={run.dir} --overwrite` (Python: invoke(overwrite=True)); a run to be "
        f"resumed or extended later needs checkpoint.at_end=true (the default)"
    )


def resume_trainer(
    trainer: Any, run: Run, resume_from: tuple[Path, dict[str, Any]], *, own_envs: bool
) -> bool:
    """Restore ``trainer`` from the checkpoint and rewind the metric files to it (records
    of later epochs, written before a crash, are dropped: every epoch appears once).
    Returns whether anything is left to train: False for a run at its last epoch, which
    the caller leaves as it is (no file rewritten)."""
    path, ckpt = resume_from
    done, planned = completed_epochs(ckpt), trainer.num_epochs
    if done > planned:  # before anything changes: the run stays as it was
        raise ValueError(
            f"{path} is at the end of epoch {done} ({ckpt['agent_step']} agent steps), past "
            f"the {planned} epochs of trainer.total_timesteps={trainer.cfg.total_timesteps}: "
            f"nothing would be trained; raise trainer.total_timesteps above "
            f"{ckpt['agent_step']} to continue the run"
        )
    restore_trainer(trainer, ckpt, restore_envs=own_envs)
    trainer.state.last_checkpoint = path  # the newest finite one until the run writes more
    if done == planned and not ckpt.get("mid_epoch"):
        log.warning(
            f"{path} is at the run's last epoch ({done} of trainer.total_timesteps="
            f"{trainer.cfg.total_timesteps}): nothing is left to train, and the run is left "
            f"as it was (no file changed); raise trainer.total_timesteps to train further"
        )
        return False
    run.rewind(done)
    mid = " (mid-epoch)" if ckpt.get("mid_epoch") else ""
    log.warning(
        f"resuming from {path}: epoch {ckpt['epoch']}{mid}, optimizer step {ckpt['optimizer_step']}"
    )
    return True
