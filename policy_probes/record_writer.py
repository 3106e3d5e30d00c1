"""RecordWriter: the driver of a run whose metrics other processes computed (RLlib's
learner actors) writes them into the one run directory::

    writer = RecordWriter(Run("runs/rllib", resume=True), probing=settings, config=cfg)
    writer.write(metrics_from_the_learners, step=env_steps)  # one POST_EPOCH record
    writer.close()

The records pass through the same live analysis (findings) and sinks as a
:class:`~policy_probes.session.ProbeSession`'s; epochs number from 1 and continue after
the last recorded one on ``resume``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_probes.analysis.live import LiveAnalysis
from policy_probes.probe_settings import ProbeSettings
from policy_probes.records import POST_EPOCH, Record, plain_metrics
from policy_probes.run import Run


class RecordWriter:
    """Write records a driver did not compute into one run directory (lock, ``config.json``,
    JSONL/CSV/W&B sinks, findings for ``policy-probes report``).

    Args:
        run: a :class:`Run` or a path, opened now (lock and claim; ``Run(..., resume=True)``
            continues the epochs after the last recorded one).
        probing: the settings whose ``sinks`` and ``wandb`` are used.
        config: the run configuration (``config.json``, the W&B run config).
    """

    def __init__(
        self,
        run: Run | str | Path,
        *,
        probing: ProbeSettings | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.run = run if isinstance(run, Run) else Run(run)
        self.probing = probing if probing is not None else ProbeSettings()
        self.run.config = {**self.run.config, **dict(config or {})}
        self.analysis = LiveAnalysis(max_epochs=self.probing.wandb.heatmap_history)
        self.closed = self._started = False
        if not self.run.opened:
            self.run.open()
        last = self.run.last_recorded_epoch() if self.run.resume else None
        #: epochs written so far (the next record is ``epoch + 1``)
        self.epoch = last or 0

    @property
    def run_dir(self) -> Path:
        return self.run.dir

    def _start(self) -> None:
        self.run.write_config()
        sinks = self.run.open_sinks(self.probing.sinks, self.probing.wandb)
        sinks.draw_figures = self.analysis.figures
        self.analysis.with_figures = any(s.logs_figures for s in sinks)
        if self.run.resume and self.run.main:  # the records before the resume
            self.analysis.load(self.run.dir)
        self._started = True

    def rewind(self, epoch: int) -> None:
        """Continue after ``epoch`` (a restored checkpoint's): later records are dropped."""
        self.run.rewind(int(epoch))
        self.epoch = int(epoch)

    def write(
        self,
        metrics: Mapping[str, Any],
        *,
        step: int | None,
        epoch: int | None = None,
        hook_point: str = POST_EPOCH,
    ) -> Record:
        """Emit one record of ``metrics`` (flattened, made plain) to every sink and return it
        as written; ``epoch``: default the next one. A POST_EPOCH record ends the epoch."""
        if self.closed:
            raise RuntimeError("this RecordWriter is closed")
        if not self._started:
            self._start()
        number = self.epoch + 1 if epoch is None else int(epoch)
        if number < 1:
            raise ValueError(f"epochs number from 1, got {number}")
        record = Record.of(plain_metrics(metrics), number, hook_point, step)
        record = self.analysis.add(record)
        self.run.sinks.emit(record)
        if hook_point == POST_EPOCH:
            self.epoch = max(self.epoch, number)
        return record

    def flush(self) -> None:
        """Hand every written record to the operating system (fsync; before a checkpoint)."""
        self.run.sinks.flush()

    def close(self) -> None:
        """Flush and close the sinks, release the lock (idempotent)."""
        if not self.closed:
            self.closed = True
            self.run.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
