"""MetricsHook: one flat metrics dict per epoch, emitted to every sink.

At each epoch end it asks the trainer to fire the lifecycle points POST_EPOCH and
SNAPSHOT (:meth:`~trainers.ppo.PPOTrainer.fire_epoch_end_points`; the ``stats_reporter``
hook among them turns the probe trackers into ``probes/*`` metrics and resets them for
the next window), merges the hooks' metrics with the loss, rollout, performance and
evaluation statistics of :class:`~trainers.callbacks.TrainerState`, stores the result in
``state.metrics`` and emits, in this order:

* one record per step point that reported metrics this epoch, hook point
  ``"PRE_STEP"`` / ``"POST_STEP"``, holding that point's per-epoch means;
* the epoch's main record, hook point ``"POST_EPOCH"``: trainer statistics and every
  hook metric of the epoch (PRE_EPOCH, POST_ROLLOUT, POST_EPOCH, SNAPSHOT, and the
  step-point means);
* in SNAPSHOT epochs (every ``snapshot_every``), a ``"SNAPSHOT"`` record with the
  SNAPSHOT hooks' metrics, which is what makes the console sink print its table and
  the W&B sink log its heatmaps.

Keys: ``train/*`` (losses, KL, clipfrac, explained variance, learning rate, grad norm),
``rollout/*`` (episode return/length of episodes that ended in the rollout), ``perf/*``
(SPS), ``eval/*`` (only in epochs with an evaluation), ``probes/*``, and
``<hook_name>/<metric>`` of the lifecycle hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from policy_probes.sinks.base import MetricSink, SinkGroup
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
    """Collects per-epoch metrics (trainer statistics + lifecycle hooks) and emits them
    to ``sinks`` (fault-isolated).

    It runs on every rank: its POST_EPOCH firing all-reduces the probe trackers, a
    collective that must come at the same place among every rank's hooks. Ranks other
    than 0 get an empty sink group, so only rank 0 emits.
    """

    run_on_all_ranks = True

    def __init__(self, sinks: Iterable[MetricSink] | SinkGroup = ()) -> None:
        self.sinks = sinks if isinstance(sinks, SinkGroup) else SinkGroup(sinks)

    def on_new_training_run(self, state: TrainerState) -> None:
        self.sinks.set_run_context(
            agent_step=state.agent_step, run_dir=state.run_dir, config=state.config
        )

    def on_epoch_end(self, state: TrainerState) -> None:
        hooks = state.trainer.fire_epoch_end_points()
        metrics = epoch_metrics(state)
        metrics.update(hooks.metrics)
        state.probe_metrics = {k: v for k, v in hooks.metrics.items() if k.startswith("probes/")}
        state.metrics = metrics
        self.sinks.set_run_context(agent_step=state.agent_step)
        for point, values in hooks.steps.items():
            self.sinks.emit(values, state.epoch, point)
        self.sinks.emit(metrics, state.epoch, "POST_EPOCH")
        if hooks.snapshot is not None:
            self.sinks.emit(hooks.snapshot, state.epoch, "SNAPSHOT")

    def on_training_end(self, state: TrainerState) -> None:
        self.sinks.flush()
