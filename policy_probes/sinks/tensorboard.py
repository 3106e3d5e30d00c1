"""TensorBoardSink: event files in ``run_dir/tensorboard`` (needs ``tensorboard``).

Scalars, per-unit vectors as histograms, and the run's figures at SNAPSHOT emits and at
close as images; the x axis is ``agent_step`` (CleanRL's ``global_step``), else the epoch."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from policy_probes.plugins import register
from policy_probes.records import Figures, Record, finite_values, is_finite_number
from policy_probes.sinks.base import MetricSink
from policy_probes.sinks.config import SinkSetup

TENSORBOARD_DIR = "tensorboard"


@register
class TensorBoardSink(MetricSink):
    """Metrics to TensorBoard event files."""

    name = "tensorboard"
    logs_figures = True

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer needs the tensorboard package
            raise ImportError(
                "the TensorBoard sink needs the `tensorboard` package: pip install tensorboard "
                "(or policy-probes[tensorboard]), or set sinks.tensorboard=false"
            ) from exc
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self._last_step: int | None = None
        self._last_epoch: int | None = None
        self._figures_at: int | None = None

    @classmethod
    def from_setup(cls, setup: SinkSetup) -> TensorBoardSink:
        return cls(setup.run_dir)

    def emit(self, record: Record) -> None:
        step = record.agent_step if record.agent_step is not None else record.epoch
        self.writer.add_scalar("epoch", record.epoch, step)
        for key, value in record.metrics.items():
            if isinstance(value, list):
                finite = finite_values(value)
                if finite:
                    self.writer.add_histogram(key, np.asarray(finite, dtype=np.float64), step)
            elif is_finite_number(value):
                self.writer.add_scalar(key, float(value), step)
        self._last_step, self._last_epoch = step, record.epoch
        if record.figures is not None:
            self._log_figures(record.figures, step, record.epoch)
        if record.hook_point == "POST_EPOCH":
            self.writer.flush()

    def wants_figures(self, record: Record | None) -> bool:
        """At SNAPSHOT records, and at close unless the last epoch's are logged."""
        if record is None:
            return self._last_epoch is not None and self._figures_at != self._last_epoch
        return record.hook_point == "SNAPSHOT"

    def final_figures(self, figures: Figures) -> None:
        if self._last_epoch is not None:
            self._log_figures(figures, self._last_step or 0, self._last_epoch)

    def _log_figures(self, figures: Figures, step: int, epoch: int) -> None:
        from PIL import Image

        for key, (png, _caption) in figures.items():
            rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            self.writer.add_image(key, rgb, step, dataformats="HWC")
        self._figures_at = epoch

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close()
            self.writer = None

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.log_dir)!r})"
