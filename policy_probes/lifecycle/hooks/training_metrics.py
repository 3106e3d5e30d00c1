"""training_metrics: the loop's own loss, rollout, evaluation and speed statistics."""

from __future__ import annotations

from typing import Any

from policy_probes.lifecycle.hook import TrainingHook
from policy_probes.lifecycle.run_context import RunDataContext


class TrainingMetricsHook(TrainingHook):
    """``RunDataContext.stats`` as they are, plus ``train/learning_rate``."""

    name = "training_metrics"
    runs_model = False  # reads state only; no passes through the model
    description = "losses, KL, clip fraction, explained variance, learning rate, returns, SPS"
    cost = "free"
    namespaced = False
    auto_include = True
    order = 0
    groups = ("minimal",)
    metrics = {
        "train/policy_loss": "clipped surrogate loss, mean over the update phase",
        "train/value_loss": "value loss, mean over the update phase",
        "train/entropy": "policy entropy, mean over the update phase",
        "train/clipfrac": "fraction of samples whose ratio was clipped",
        "train/approx_kl": "KL(old||new) estimator (r-1) - log r (Schulman)",
        "train/old_approx_kl": "KL estimator -log r",
        "train/grad_norm": "gradient norm before clipping, mean over the update phase",
        "train/explained_variance": "1 - Var[returns - values] / Var[returns]",
        "train/learning_rate": "learning rate of the epoch",
        "rollout/episode_return": "mean return of the episodes finished in the rollout",
        "rollout/episode_length": "mean length of those episodes",
        "perf/sps": "environment steps per second",
        "eval/*": "evaluation results when the loop evaluates",
    }

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        out = dict(ctx.stats)
        if ctx.learning_rate is not None:
            out.setdefault("train/learning_rate", float(ctx.learning_rate))
        return out
