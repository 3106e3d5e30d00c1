"""The clocks of a benchmark case's timed region (:mod:`benchmarks.cases`): wall time,
the measurement, and the process's CPU time, its cross-check on a loaded machine."""

from __future__ import annotations

import time
from typing import Any


class Clocks:
    """Wall and CPU seconds of a case's timed region: from construction to :meth:`stop`."""

    def __init__(self) -> None:
        self.start = time.perf_counter(), time.process_time()
        self.seconds = self.cpu_seconds = float("nan")

    def stop(self) -> None:
        wall, cpu = self.start
        self.seconds, self.cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu

    def result(self, steps: int, **extra: Any) -> dict[str, Any]:
        """The JSON line of a case: the region's seconds, the steps it trained and their
        rate, then ``extra``."""
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "steps": steps,
            "sps": steps / self.seconds,
            **extra,
        }
