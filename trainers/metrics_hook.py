"""MetricsHook: one flat metrics dict per epoch, emitted to every sink.

At each epoch end it turns the probe trackers into metrics (``StatsReporter.collect()``,
which also resets them for the next window), merges them with the loss, rollout,
performance and evaluation statistics of :class:`~trainers.callbacks.TrainerState`, stores
the result in ``state.metrics`` and emits it with hook point ``"POST_EPOCH"`` to every
sink. Keys: ``train/*`` (losses, KL, clipfrac, explained variance, learning rate, grad
norm), ``rollout/*`` (episode return/length of episodes that ended in the rollout),
``perf/*`` (SPS), ``eval/*`` (only in epochs with an evaluation), ``probes/*``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from policy_probes.sinks.base import MetricSink, SinkGroup
from policy_probes.stats_reporter import StatsReporter
from trainers.callbacks import TrainerHook, TrainerState

ROLLOUT_KEYS = (
    "episode_return",
    "episode_length",
    "episodes",
    "episode_return_max",
    "episode_return_min",
)
PERF_KEYS = ("sps", "rollout_sps", "update_seconds")


def epoch_metrics(state: TrainerState) -> dict[str, Any]:
    """The trainer's own statistics of the current epoch as ``section/name`` keys."""
    out: dict[str, Any] = {f"train/{k}": v for k, v in state.loss_stats.items()}
    out.update(
        {f"rollout/{k}": state.rollout_stats[k] for k in ROLLOUT_KEYS if k in state.rollout_stats}
    )
    if "valid_fraction" in state.rollout_stats:
        out["rollout/valid_fraction"] = state.rollout_stats["valid_fraction"]
    out.update({f"perf/{k}": state.rollout_stats[k] for k in PERF_KEYS if k in state.rollout_stats})
    if state.eval_scores.get("epoch") == float(state.epoch):
        out.update({f"eval/{k}": v for k, v in state.eval_scores.items() if k != "epoch"})
    if state.hook_errors:
        out["trainer/hook_errors"] = float(len(state.hook_errors))
    return out


class MetricsHook(TrainerHook):
    """Collects per-epoch metrics and emits them to ``sinks`` (fault-isolated)."""

    def __init__(self, sinks: Iterable[MetricSink] | SinkGroup = ()) -> None:
        self.sinks = sinks if isinstance(sinks, SinkGroup) else SinkGroup(sinks)

    def on_new_training_run(self, state: TrainerState) -> None:
        self.sinks.set_run_context(
            agent_step=state.agent_step, run_dir=state.run_dir, config=state.config
        )

    def on_epoch_end(self, state: TrainerState) -> None:
        state.probe_metrics = StatsReporter(state.context).collect()
        metrics = epoch_metrics(state)
        metrics.update(state.probe_metrics)
        state.metrics = metrics
        self.sinks.set_run_context(agent_step=state.agent_step)
        self.sinks.emit(metrics, state.epoch, "POST_EPOCH")

    def on_training_end(self, state: TrainerState) -> None:
        self.sinks.flush()
