"""A small but real training loop for the lifecycle tests.

An actor-critic MLP on CartPole rollouts (gymnasium vector env), a PPO loss, Adam, a
linear learning-rate schedule, gradient clipping, minibatch orders drawn from torch,
numpy and Python RNGs, with every hook point fired where the PPO trainer fires it.
The model and the rollout tensors live on ``run_training(device=...)`` (the CPU by
default); the environments step on the host.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import conftest
import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from policy_probes import ComponentContext, LinearSpec, MLPSpec, PolicyAutoBuilder, StatsReporter
from policy_probes.lifecycle import (
    HookManager,
    HookPoint,
    LoopModelDataContext,
    TrainingHook,
    snapshot_due,
)


class ActorCritic(PolicyAutoBuilder):
    def __init__(
        self,
        obs: int = 4,
        hidden: tuple[int, ...] = (16, 16),
        actions: int = 2,
        activation: str = "relu",
    ):
        super().__init__(
            {
                "actor_mlp": MLPSpec(
                    in_features=obs, hidden_sizes=list(hidden), activation=activation
                ),
                "actor_head": LinearSpec(in_features=hidden[-1], out_features=actions),
                "critic_mlp": MLPSpec(
                    in_features=obs, hidden_sizes=list(hidden), activation=activation
                ),
                "critic_head": LinearSpec(in_features=hidden[-1], out_features=1),
            }
        )
        self.trace_outputs(torch.zeros(1, obs))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor_head(self.actor_mlp(obs)), self.critic_head(self.critic_mlp(obs)).squeeze(
            -1
        )

    def get_distribution(self, obs: torch.Tensor) -> Categorical:
        return Categorical(logits=self.actor_head(self.actor_mlp(obs)))


def ppo_loss(model: ActorCritic, batch: dict[str, torch.Tensor], clip: float = 0.2) -> torch.Tensor:
    logits, value = model(batch["obs"])
    dist = Categorical(logits=logits)
    logp = dist.log_prob(batch["actions"])
    adv = batch["advantages"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = (logp - batch["logprobs"]).exp()
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
    v_loss = 0.5 * (value - batch["returns"]).square().mean()
    return pg + 0.5 * v_loss - 0.01 * dist.entropy().mean()


def collect(
    envs: gym.vector.VectorEnv, model: ActorCritic, obs: np.ndarray, steps: int
) -> tuple[dict, np.ndarray]:
    """A rollout with GAE(0.99, 0.95); episode boundaries simply cut the bootstrap. The
    tensors are on the model's device (the actions go to the host for the envs)."""
    n = envs.num_envs
    device = next(model.parameters()).device
    buf: dict[str, list] = {
        k: [] for k in ("obs", "actions", "logprobs", "values", "rewards", "dones")
    }
    for _ in range(steps):
        o = torch.as_tensor(obs, dtype=torch.float32).to(device)
        with torch.no_grad():
            logits, v = model(o)
            dist = Categorical(logits=logits)
            a = dist.sample()
        obs, r, term, trunc, _ = envs.step(a.cpu().numpy())
        buf["obs"].append(o)
        buf["actions"].append(a)
        buf["logprobs"].append(dist.log_prob(a))
        buf["values"].append(v)
        buf["rewards"].append(torch.as_tensor(r, dtype=torch.float32).to(device))
        buf["dones"].append(torch.as_tensor(term | trunc, dtype=torch.float32).to(device))
    with torch.no_grad():
        _, last_v = model(torch.as_tensor(obs, dtype=torch.float32).to(device))
    adv = torch.zeros(steps, n).to(device)
    gae = torch.zeros(n).to(device)
    for t in reversed(range(steps)):
        nxt = last_v if t == steps - 1 else buf["values"][t + 1]
        nonterminal = 1.0 - buf["dones"][t]
        delta = buf["rewards"][t] + 0.99 * nxt * nonterminal - buf["values"][t]
        gae = delta + 0.99 * 0.95 * nonterminal * gae
        adv[t] = gae
    values = torch.stack(buf["values"])
    data = {
        "obs": torch.stack(buf["obs"]).reshape(steps * n, -1),
        "actions": torch.stack(buf["actions"]).reshape(-1),
        "logprobs": torch.stack(buf["logprobs"]).reshape(-1),
        "advantages": adv.reshape(-1),
        "returns": (adv + values).reshape(-1),
    }
    return data, obs


@dataclass
class RunResult:
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    manager: HookManager | None = None
    #: the global generators after the run: torch CPU, numpy's keys, Python's, and the
    #: torch CUDA states (one per device; empty unless the run was on CUDA)
    rng_after: tuple[Any, ...] = ()


def attach_all_probes(model: ActorCritic, context: ComponentContext) -> None:
    """The ReLU probe and the three backward probes on both MLPs."""
    for comp in ("actor_mlp", "critic_mlp"):
        conftest.attach_all_probes(model, context, comp)


def run_training(
    hooks: list[TrainingHook] | None = None,
    *,
    probes: bool = False,
    epochs: int = 3,
    seed: int = 0,
    num_envs: int = 2,
    num_steps: int = 32,
    minibatch_size: int = 16,
    update_epochs: int = 2,
    snapshot_every: int = 2,
    device: torch.device | str = "cpu",
) -> RunResult:
    """The loop for ``epochs`` epochs with ``hooks`` (and the probes when ``probes``), its
    model built on the CPU from ``seed`` and then moved to ``device``."""
    device = torch.device(device)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
    obs, _ = envs.reset(seed=seed)
    model = ActorCritic().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 - e / (epochs + 1))
    context = ComponentContext()
    if probes:
        attach_all_probes(model, context)
    mctx = LoopModelDataContext(
        model, opt, ppo_loss, scheduler=sched, max_grad_norm=0.5, update_epochs=update_epochs
    )
    manager = HookManager(
        hooks or [],
        model=model,
        optimizer=opt,
        scheduler=sched,
        component_context=context,
        loop="ppo",
    )
    history: list[dict[str, Any]] = []
    step = 0
    for epoch in range(epochs):
        metrics = manager.fire(HookPoint.PRE_EPOCH, epoch=epoch, model_ctx=mctx)
        context.phase = "rollout"
        data, obs = collect(envs, model, obs, num_steps)
        context.phase = "train"
        mctx.set_data(data=data, minibatch_size=minibatch_size)
        metrics.update(
            manager.fire(
                HookPoint.POST_ROLLOUT, epoch=epoch, observations=data["obs"], model_ctx=mctx
            )
        )
        n = data["obs"].shape[0]
        losses = []
        for ue in range(update_epochs):
            # orders from all three global generators, so each one matters
            order = torch.randperm(n) if ue % 2 == 0 else torch.as_tensor(np.random.permutation(n))
            if random.random() < 0.5:
                order = order.flip(0)
            for mb in mctx.minibatches(order):
                opt.zero_grad()
                loss = ppo_loss(model, mb)
                loss.backward()
                manager.fire(
                    HookPoint.PRE_STEP,
                    epoch=epoch,
                    step=step,
                    batch=mb,
                    loss=loss.detach(),
                    model_ctx=mctx,
                )
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                manager.fire(HookPoint.POST_STEP, epoch=epoch, step=step, batch=mb, model_ctx=mctx)
                losses.append(loss.detach())
                step += 1
        sched.step()
        stats = {"train/loss": float(torch.stack(losses).mean())}
        metrics.update(StatsReporter(context).collect())  # as ProbeSession.epoch_end does
        metrics.update(
            manager.fire(
                HookPoint.POST_EPOCH,
                epoch=epoch,
                step=step,
                stats=stats,
                learning_rate=sched.get_last_lr()[0],
                model_ctx=mctx,
            )
        )
        if snapshot_due(epoch, snapshot_every):
            metrics.update(manager.fire(HookPoint.SNAPSHOT, epoch=epoch, step=step, model_ctx=mctx))
        metrics.update(manager.flush().summary)
        history.append(metrics)
    envs.close()
    model.remove_hooks()
    return RunResult(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        optimizer_state=opt.state_dict(),
        metrics=history,
        manager=manager,
        rng_after=(
            torch.get_rng_state(),
            np.random.get_state()[1].copy(),
            random.getstate(),
            tuple(torch.cuda.get_rng_state_all()) if device.type == "cuda" else (),
        ),
    )
