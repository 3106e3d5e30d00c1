"""Metric sinks: where per-epoch metrics go (JSONL, CSV, W&B, TensorBoard, the console).

Typical use (a :class:`~policy_probes.session.ProbeSession` does this for a training
loop, adding the run's findings and figures)::

    group = build_sink_group(run_dir, SinksConfig(), WandbConfig(), config=resolved_config)
    group.emit(Record.of(metrics, epoch, "POST_EPOCH", agent_step))
    ...
    group.close()

Sinks that need heavy imports (rich, wandb, matplotlib, tensorboard) are imported only
when used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_probes.sinks.base import MetricSink, SinkGroup
from policy_probes.sinks.config import DEFAULT_CONSOLE_METRICS, SinksConfig, WandbConfig
from policy_probes.sinks.jsonl import JSONLSink, repair_truncated_tail, rewind_jsonl

if TYPE_CHECKING:
    from rich.console import Console

    from policy_probes.sinks.console import ConsoleSink
    from policy_probes.sinks.csv_sink import CSVSink
    from policy_probes.sinks.tensorboard import TensorBoardSink
    from policy_probes.sinks.wandb_sink import WandbSink

logger = logging.getLogger("policy_probes.sinks")

__all__ = [
    "DEFAULT_CONSOLE_METRICS",
    "CSVSink",
    "ConsoleSink",
    "JSONLSink",
    "MetricSink",
    "SinkGroup",
    "SinksConfig",
    "TensorBoardSink",
    "WandbConfig",
    "WandbSink",
    "build_sink_group",
    "build_sinks",
    "repair_truncated_tail",
    "rewind_jsonl",
]

_LAZY = {
    "CSVSink": "policy_probes.sinks.csv_sink",
    "ConsoleSink": "policy_probes.sinks.console",
    "TensorBoardSink": "policy_probes.sinks.tensorboard",
    "WandbSink": "policy_probes.sinks.wandb_sink",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'policy_probes.sinks' has no attribute {name!r}")


def build_sinks(
    run_dir: Path,
    sinks: SinksConfig,
    wandb: WandbConfig,
    config: dict[str, Any],
    *,
    console: Console | None = None,
    failures: dict[str, str] | None = None,
) -> list[MetricSink]:
    """Create the sinks that ``sinks`` switches on, writing under ``run_dir``.

    Each sink starts inside its own ``try``: one that cannot start (read-only directory,
    W&B init error, missing package) is reported once with the reason (logged at error
    level and stored in ``failures`` when given) and left out; the others go on.

    Args:
        run_dir: the run directory (created if absent).
        sinks: which sinks to create.
        wandb: the W&B run settings (``mode="disabled"`` creates no W&B sink).
        config: the resolved run configuration, stored in the W&B run's config.
        console: a rich Console to share with a progress bar (the console sink's output).
        failures: filled with ``sink name -> reason`` for every sink that failed to start.
    """
    run_dir = Path(run_dir)
    factories: list[tuple[str, Any]] = []
    if sinks.jsonl:
        factories.append(("jsonl", lambda: JSONLSink(run_dir, fsync_seconds=sinks.fsync_seconds)))
    if sinks.csv:

        def _csv() -> MetricSink:
            from policy_probes.sinks.csv_sink import CSVSink

            return CSVSink(run_dir, fsync_seconds=sinks.fsync_seconds)

        factories.append(("csv", _csv))
    if sinks.tensorboard:

        def _tb() -> MetricSink:
            from policy_probes.sinks.tensorboard import TensorBoardSink

            return TensorBoardSink(run_dir)

        factories.append(("tensorboard", _tb))
    if sinks.wandb and wandb.resolved_mode() != "disabled":

        def _wandb() -> MetricSink:
            from policy_probes.sinks.wandb_sink import WandbSink

            return WandbSink(run_dir, wandb, config)

        factories.append(("wandb", _wandb))
    if sinks.console:

        def _console() -> MetricSink:
            from policy_probes.sinks.console import ConsoleSink

            return ConsoleSink(
                console=console, metrics=sinks.console_metrics, live=sinks.console_live
            )

        factories.append(("console", _console))

    built: list[MetricSink] = []
    for name, factory in factories:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            sink = factory()
            sink.set_run_context(run_dir=run_dir, config=config)
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
            continue
        built.append(sink)
    return built


def build_sink_group(
    run_dir: Path,
    sinks: SinksConfig,
    wandb: WandbConfig,
    config: dict[str, Any],
    *,
    console: Console | None = None,
) -> SinkGroup:
    """:func:`build_sinks` wrapped in a fault-isolating :class:`SinkGroup` whose
    ``failures`` already lists the sinks that could not start."""
    failures: dict[str, str] = {}
    group = SinkGroup(
        build_sinks(run_dir, sinks, wandb, config, console=console, failures=failures)
    )
    group.failures.update(failures)
    return group
