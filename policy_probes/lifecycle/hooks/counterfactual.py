"""counterfactual: how much the update depended on the minibatch order.

Replays the epoch's whole update phase (``update_epochs`` epochs) from the pre-epoch
state with other random minibatch orders, and compares the resulting parameters and
losses with the real update theta_real (everything is undone by the guardian)."""

from __future__ import annotations

import itertools
import math
from statistics import fmean
from typing import Any

import torch
from pydantic import Field

from policy_probes.lifecycle.hook import HookConfig, InterventionHook
from policy_probes.lifecycle.model_context import ModelDataContext
from policy_probes.lifecycle.run_context import RunDataContext


class CounterfactualConfig(HookConfig):
    replays: int = Field(2, ge=1, description="replayed update phases (at least 1)")
    update_epochs: int | None = Field(None, ge=1, description="None = the loop's own")
    seed: int = Field(0, ge=0)


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in params.values()])


def order_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator the replay orders of ``epoch`` are drawn from."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


class CounterfactualHook(InterventionHook):
    """theta_r = update phase replayed from the pre-epoch state with random orders drawn
    from ``torch.Generator().manual_seed(seed * 1_000_003 + epoch)``; losses are the
    training loss on the current data (mean over minibatches)."""

    name = "counterfactual"
    description = "replays the update with shuffled minibatch orders; distance to the real update"
    needs_pre_epoch_state = True
    Config = CounterfactualConfig
    metrics = {
        "param_distance": "mean over replays of ||theta_r - theta_real||",
        "param_distance_max": "largest of those distances",
        "update_norm": "||theta_real - theta_pre||",
        "relative_distance": "param_distance / update_norm",
        "update_cosine": "mean cosine between (theta_r - theta_pre) and (theta_real - theta_pre)",
        "replay_spread": "mean ||theta_r - theta_q|| over pairs of replays",
        "loss_real": "loss at theta_real",
        "loss_replay": "mean loss at theta_r",
        "loss_delta": "mean of loss(theta_r) - loss(theta_real)",
    }

    def intervene(self, run_ctx: RunDataContext, model_ctx: ModelDataContext) -> dict[str, Any]:
        cfg = self.config
        epochs = cfg.update_epochs or model_ctx.update_epochs
        params = model_ctx.named_parameters()
        real = _flat(params)
        with torch.no_grad():
            loss_real = float(model_ctx.compute_loss())
        model_ctx.restore_pre_epoch()
        pre = _flat(params)
        gen = order_generator(cfg.seed, run_ctx.epoch)
        replays, losses = [], []
        for _ in range(cfg.replays):
            model_ctx.restore_pre_epoch()
            for _ in range(epochs):
                model_ctx.run_training_epoch(order=model_ctx.random_order(generator=gen))
            replays.append(_flat(params))
            with torch.no_grad():
                losses.append(float(model_ctx.compute_loss()))
        norm, cosine = torch.linalg.vector_norm, torch.nn.functional.cosine_similarity
        update = real - pre
        update_norm = float(norm(update))
        dists = [float(norm(r - real)) for r in replays]
        cosines = [float(cosine(r - pre, update, dim=0, eps=1e-30)) for r in replays]
        pairs = [float(norm(a - b)) for a, b in itertools.combinations(replays, 2)]
        out: dict[str, Any] = {
            "param_distance": fmean(dists),
            "param_distance_max": max(dists),
            "update_norm": update_norm,
            "relative_distance": fmean(dists) / update_norm if update_norm > 0 else math.nan,
            "update_cosine": fmean(cosines),
            "loss_real": loss_real,
            "loss_replay": fmean(losses),
            "loss_delta": fmean([x - loss_real for x in losses]),
        }
        if pairs:
            out["replay_spread"] = fmean(pairs)
        return out
