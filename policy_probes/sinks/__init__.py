"""Metric sinks: where per-epoch metrics go (JSONL, CSV, W&B, TensorBoard, the console).

Each sink is a plugin (:mod:`policy_probes.plugins`) a run opens when its configuration
switches it on (``sinks.<name>=true``); a :class:`~policy_probes.session.ProbeSession` does::

    group = build_sink_group(run_dir, SinksConfig(), WandbConfig(), config=resolved_config)
    group.emit(Record.of(metrics, epoch, "POST_EPOCH", agent_step))
    group.close()"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_probes import plugins
from policy_probes.sinks.base import MetricSink, SinkGroup, repair_truncated_tail
from policy_probes.sinks.config import SinksConfig, SinkSetup, WandbConfig, default_console_metrics

# the built-in sinks register in this order, the order a run opens them in
# isort: off
from policy_probes.sinks.jsonl import JSONLSink, rewind_jsonl
from policy_probes.sinks.csv_sink import CSVSink
from policy_probes.sinks.tensorboard import TensorBoardSink
from policy_probes.sinks.wandb_sink import WandbSink
from policy_probes.sinks.console import ConsoleSink

# isort: on

if TYPE_CHECKING:
    from rich.console import Console

logger = logging.getLogger("policy_probes.sinks")

__all__ = [
    "CSVSink",
    "ConsoleSink",
    "JSONLSink",
    "MetricSink",
    "SinkGroup",
    "SinkSetup",
    "SinksConfig",
    "TensorBoardSink",
    "WandbConfig",
    "WandbSink",
    "build_sink_group",
    "build_sinks",
    "default_console_metrics",
    "repair_truncated_tail",
    "rewind_jsonl",
]


def build_sinks(
    run_dir: Path,
    sinks: SinksConfig,
    wandb: WandbConfig,
    config: dict[str, Any],
    *,
    console: Console | None = None,
    failures: dict[str, str] | None = None,
) -> list[MetricSink]:
    """Create the sinks that ``sinks`` switches on, writing under ``run_dir``; ``config``
    goes to the W&B run, ``console`` (shared with a progress bar) to the console sink. A
    sink that cannot start is logged with the reason, recorded in ``failures`` (name ->
    reason) when given, and left out; the others go on."""
    setup = SinkSetup(Path(run_dir), sinks, wandb, config, console)
    built: list[MetricSink] = []
    for name, cls in plugins.registered("sink").items():
        if not sinks.enabled(name):
            continue
        try:
            setup.run_dir.mkdir(parents=True, exist_ok=True)
            sink = cls.from_setup(setup)
            if sink is not None:
                sink.set_run_context(run_dir=setup.run_dir, config=config)
                built.append(sink)
        except Exception as exc:  # noqa: BLE001 - a sink must never stop the run
            reason = f"{type(exc).__name__}: {exc}"
            if failures is not None:
                failures[name] = f"could not start: {reason}"
            logger.error(
                "metric sink %r could not start and is left out; the other sinks and training "
                "go on. Reason: %s",
                name,
                reason,
                exc_info=exc,
            )
    return built


def build_sink_group(
    run_dir: Path,
    sinks: SinksConfig,
    wandb: WandbConfig,
    config: dict[str, Any],
    *,
    console: Console | None = None,
) -> SinkGroup:
    """:func:`build_sinks` in a :class:`SinkGroup` whose ``failures`` lists those that failed."""
    group = SinkGroup()
    group.sinks = build_sinks(
        run_dir, sinks, wandb, config, console=console, failures=group.failures
    )
    return group
