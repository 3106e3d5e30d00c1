"""Real probe metrics for the sink tests: a tiny policy trained for a few epochs with the
ReLU, saturation, Fisher and gradient-flow probes attached, collected by StatsReporter;
and the emit / rewind / emit sequence every file sink's resume is tested with.

No mocks: every metric comes from real forward and backward passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from policy_probes import (
    ComponentContext,
    LinearSpec,
    MLPSpec,
    PolicyAutoBuilder,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.analysis.live import LiveAnalysis
from policy_probes.records import Record
from policy_probes.sinks import SinkGroup

#: units of actor_mlp.layer_0 forced dead (bias -50) so heatmaps show dead rows
DEAD_UNITS = (0, 1, 2)


class ProbePolicy(PolicyAutoBuilder):
    """ReLU actor (actor_mlp -> actor_head) and tanh critic (critic_mlp -> critic_head)."""

    def __init__(self, obs: int = 4, hidden: int = 12, act: int = 2) -> None:
        super().__init__(
            {
                "actor_mlp": MLPSpec(
                    in_features=obs, hidden_sizes=[hidden, hidden], activation="relu"
                ),
                "actor_head": LinearSpec(in_features=hidden, out_features=act),
                "critic_mlp": MLPSpec(in_features=obs, hidden_sizes=[hidden], activation="tanh"),
                "critic_head": LinearSpec(in_features=hidden, out_features=1),
            }
        )
        with torch.no_grad():
            first = self.actor_mlp.layer_0.linear
            for u in DEAD_UNITS:
                first.bias[u] = -50.0
                first.weight[u].zero_()
        self.trace_outputs(torch.zeros(1, obs))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor_head(self.actor_mlp(x)), self.critic_head(self.critic_mlp(x))


def probe_epochs(
    epochs: int = 3, batches: int = 4, batch_size: int = 32, seed: int = 0
) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Yield ``(epoch, agent_step, metrics)`` per epoch of a real tiny training loop."""
    torch.manual_seed(seed)
    model = ProbePolicy()
    ctx = ComponentContext()
    model.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    model.attach("actor_mlp.layer_0", attach_relu_activation_hooks(), ctx)
    model.attach("critic_mlp", attach_saturated_activation_hooks(activation="tanh"), ctx)
    model.attach("actor_mlp", attach_fisher_information_hooks(), ctx, backward=True)
    model.attach("actor_mlp", attach_gradient_flow_hooks(), ctx, backward=True)
    reporter = StatsReporter(ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent_step = 0
    try:
        for epoch in range(epochs):
            losses = []
            for _ in range(batches):
                x = torch.randn(batch_size, 4) * 2
                target = (x[:, 0] > 0).long()
                logits, value = model(x)
                loss = (
                    nn.functional.cross_entropy(logits, target)
                    + 0.5 * (value.squeeze(-1) - x[:, 1]).pow(2).mean()
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                agent_step += batch_size
            metrics = reporter.collect()
            metrics["train/policy_loss"] = float(torch.stack(losses).mean())
            metrics["rollout/episode_return"] = 10.0 + epoch
            yield epoch, agent_step, metrics
    finally:
        model.remove_hooks()


def emit_probe_run(
    sink, epochs: int = 3, snapshot_every: int | None = None
) -> list[tuple[int, int, dict[str, Any]]]:
    """Feed a real probe run into ``sink`` as a session does (POST_EPOCH each epoch,
    SNAPSHOT every ``snapshot_every`` epochs; each record through a live analysis, which
    draws the figures a sink in a :class:`SinkGroup` asks for) and return what was
    emitted."""
    analysis = LiveAnalysis()
    if isinstance(sink, SinkGroup):
        sink.draw_figures = analysis.figures
    emitted = []
    for epoch, step, metrics in probe_epochs(epochs):
        sink.emit(analysis.add(Record.of(metrics, epoch, "POST_EPOCH", step)))
        if snapshot_every and (epoch + 1) % snapshot_every == 0:
            sink.emit(analysis.add(Record.of({}, epoch, "SNAPSHOT", step)))
        emitted.append((epoch, step, metrics))
    return emitted


def files_under(path: Path) -> list[Path]:
    return [p for p in Path(path).rglob("*") if p.is_file()]


def tiny_cartpole(run_dir: Path, epochs: int = 3, **sections: Any):
    """The CartPole recipe (its four ReLU probes on actor_mlp and critic_mlp) shrunk to
    ``epochs`` epochs of 4 x 128 steps, no evaluation, no checkpoints; ``sections``
    update fields (e.g. ``wandb=WandbConfig(...)``)."""
    from recipes.cartpole import train

    tool = train()
    update = {
        "run_dir": run_dir,
        "trainer": tool.trainer.model_copy(update={"total_timesteps": 512 * epochs}),
        "evaluation": tool.evaluation.model_copy(update={"every_epochs": 0, "at_end": False}),
        "checkpoint": tool.checkpoint.model_copy(update={"every_epochs": 0, "at_end": False}),
        "progress": False,
        "probe_budget": None,  # every pass: exact values are compared
        **sections,
    }
    return tool.model_copy(update=update)


def rewind_and_emit(sink: Any, epochs: int, keep: int, key: str, again: float) -> int:
    """Epochs ``0 .. epochs-1`` with ``{key: epoch}``, a rewind to epoch ``keep``, epoch
    ``keep + 1`` once more with ``{key: again}``, the sink closed; returns what the
    rewind reported (the records it dropped)."""
    for epoch in range(epochs):
        sink.emit(Record.of({key: float(epoch)}, epoch))
    dropped = sink.rewind(keep)
    sink.emit(Record.of({key: again}, keep + 1))
    sink.close()
    return dropped
