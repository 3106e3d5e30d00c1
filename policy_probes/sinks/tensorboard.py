"""TensorBoardSink: event files in ``run_dir/tensorboard`` for CleanRL-style tooling.

Needs the ``tensorboard`` package (``pip install policy-probes[tensorboard]``). Scalars go
to ``add_scalar``, per-unit vectors to ``add_histogram``, and at SNAPSHOT emits (and when
the sink closes) the units x epochs heatmaps to ``add_image`` under ``heatmaps/...``. The
x axis is the environment step (``agent_step``, as CleanRL's ``global_step``), or the epoch
when no step is known; the epoch itself is logged as the scalar ``epoch``.

View with ``tensorboard --logdir run_dir/tensorboard``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_probes.heatmaps import VectorHistory, heatmap_spec, render_heatmaps
from policy_probes.sinks.base import (
    MetricSink,
    finite_values,
    is_finite_number,
    plain_metrics,
)

TENSORBOARD_DIR = "tensorboard"


class TensorBoardSink(MetricSink):
    """Metrics to TensorBoard event files."""

    name = "tensorboard"

    def __init__(self, run_dir: str | Path, heatmap_history: int = 1000) -> None:
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
        self.history = VectorHistory(heatmap_history)
        self._last_step: int | None = None
        self._last_epoch: int | None = None
        self._heatmaps_at: int | None = None

    def _step(self, epoch: int) -> int:
        step = self.run_context.get("agent_step")
        return int(step) if step is not None else int(epoch)

    def emit(self, metrics: Mapping[str, Any], epoch: int, hook_point: str) -> None:
        step = self._step(epoch)
        self.writer.add_scalar("epoch", int(epoch), step)
        for key, value in plain_metrics(metrics):
            if isinstance(value, list):
                finite = finite_values(value)
                if finite:
                    self.writer.add_histogram(key, np.asarray(finite, dtype=np.float64), step)
                if heatmap_spec(key) is not None:
                    self.history.add(key, int(epoch), value)
            elif is_finite_number(value):
                self.writer.add_scalar(key, float(value), step)
        self._last_step, self._last_epoch = step, int(epoch)
        if hook_point == "SNAPSHOT":
            self._log_heatmaps(step, int(epoch))
        if hook_point == "POST_EPOCH":
            self.writer.flush()

    def _log_heatmaps(self, step: int, epoch: int) -> None:
        from PIL import Image

        for key, (png, _caption) in render_heatmaps(self.history).items():
            rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            self.writer.add_image(key, rgb, step, dataformats="HWC")
        self._heatmaps_at = epoch

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is None:
            return
        try:
            if (
                len(self.history)
                and self._last_epoch is not None
                and self._heatmaps_at != self._last_epoch
            ):
                self._log_heatmaps(self._last_step or 0, self._last_epoch)
        finally:
            writer.close()
            self.writer = None

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.log_dir)!r})"
