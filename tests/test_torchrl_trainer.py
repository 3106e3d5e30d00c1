"""TorchRL's own PPOTrainer (Collector, ClipPPOLoss, GAE, a replay buffer without
replacement) on CartPole with a ProbeTrainerHook: every record is checked against the same
minibatches' activations and gradients captured with plain torch hooks, and a trainer
checkpoint carries the session into a restored trainer."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict.nn import TensorDictModule
from test_session import Capture, check_tanh_saturation, fisher_reference
from torch import nn
from torchrl.checkpoint import Checkpoint
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import GymEnv
from torchrl.modules import OneHotCategorical, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.trainers.algorithms import PPOTrainer  # the torchrl extra: runs for real

from policy_probes import (
    ProbeSettings,
    Run,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.integrations.torchrl import ProbeTrainerHook
from policy_probes.records import read_jsonl
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig

FRAMES, MINIBATCH, EPOCHS, HIDDEN = 128, 32, 2, 16
STEPS = EPOCHS * FRAMES // MINIBATCH  # optimizer steps per collected batch
DEAD = (0, 1, 2)  # units of actor_mlp.0 killed before training
COMPONENTS = {"actor_mlp": "actor.module.0.module", "critic_mlp": "critic.module"}


def make_agent(seed: int) -> tuple[ProbabilisticActor, ValueOperator, nn.Sequential]:
    torch.manual_seed(seed)
    env = GymEnv("CartPole-v1")
    mlp = nn.Sequential(
        nn.Linear(4, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 2)
    )
    with torch.no_grad():
        for u in DEAD:
            mlp[0].weight[u].zero_()
            mlp[0].bias[u] = -50.0
    actor = ProbabilisticActor(
        TensorDictModule(mlp, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=OneHotCategorical,
        spec=env.action_spec,
        return_log_prob=True,
    )
    critic = ValueOperator(
        nn.Sequential(nn.Linear(4, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)),
        in_keys=["observation"],
    )
    env.close()
    return actor, critic, mlp


def make_trainer(
    actor: ProbabilisticActor, critic: ValueOperator, total_frames: int, **kwargs: object
) -> PPOTrainer:
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    loss = ClipPPOLoss(actor, critic)
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
    collector = Collector(env, actor, frames_per_batch=FRAMES, total_frames=total_frames)
    buffer = TensorDictReplayBuffer(
        storage=LazyTensorStorage(FRAMES), sampler=SamplerWithoutReplacement(), batch_size=MINIBATCH
    )
    with warnings.catch_warnings():  # TorchRL's own "experimental" and stage warnings
        warnings.simplefilter("ignore")
        return PPOTrainer(
            collector=collector,
            total_frames=total_frames,
            frame_skip=1,
            # None: each epoch runs until the buffer's iterator ends (FRAMES / MINIBATCH
            # steps); FRAMES // MINIBATCH here would run every second epoch empty
            optim_steps_per_batch=None,
            num_epochs=EPOCHS,
            loss_module=loss,
            optimizer=optimizer,
            replay_buffer=buffer,
            progress_bar=False,
            enable_logging=False,
            **kwargs,
        )


def make_session(actor: ProbabilisticActor, critic: ValueOperator, run: Run) -> ProbeSession:
    session = ProbeSession(
        nn.ModuleDict({"actor": actor, "critic": critic}),
        components=COMPONENTS,
        run=run,
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, wandb=False),
            wandb=WandbConfig(mode="disabled"),
            probe_budget=None,  # every pass: exact
        ),
    )
    session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    session.add_training_hook("critic_mlp.1", attach_saturated_activation_hooks("tanh"))
    session.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    return session


def test_ppo_trainer_records_match_plain_hooks(tmp_path) -> None:
    actor, critic, mlp = make_agent(0)
    trainer = make_trainer(actor, critic, total_frames=3 * FRAMES)
    steps: list[int] = []  # every optimizer step, counted by the optimizer itself
    trainer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    losses: list[dict[str, torch.Tensor]] = []

    def loss_outputs(_module: nn.Module, _args: object, out: object) -> None:
        if torch.is_grad_enabled():  # the optimization loop's calls
            losses.append({k: v.detach().clone() for k, v in out.items()})

    trainer.loss_module.register_forward_hook(loss_outputs)
    cap = Capture(
        {"actor_mlp.1": mlp[1], "actor_mlp.3": mlp[3], "critic_mlp.1": critic.module[1]},
        {"actor_mlp": mlp, "actor_mlp.0": mlp[0], "actor_mlp.2": mlp[2], "actor_mlp.4": mlp[4]},
    )
    with make_session(actor, critic, Run(tmp_path)) as session:
        hook = ProbeTrainerHook(session)
        hook.register(trainer)
        trainer.train()
    hook.close()
    cap.remove()

    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r["agent_step"] for r in records] == [FRAMES, 2 * FRAMES, 3 * FRAMES]
    assert len(hook.history) == 3
    # the collection and GAE run without gradients: the captures are the loss's passes
    assert len(steps) == len(losses) == len(cap.out["actor_mlp.1"]) == 3 * STEPS
    for e, rec in enumerate(records):
        window = slice(e * STEPS, (e + 1) * STEPS)
        assert rec["train/optim_steps"] == STEPS
        for name in ("actor_mlp.1", "actor_mlp.3"):
            h = torch.cat(cap.out[name][window])
            active = (h > 0).double().mean(0)
            assert rec[f"probes/relu/{name}/samples"] == EPOCHS * FRAMES == h.shape[0]
            assert rec[f"probes/relu/{name}/dead_fraction"] == float((active == 0).double().mean())
        assert rec["probes/relu/actor_mlp.1/dead_fraction"] >= len(DEAD) / HIDDEN
        # the critic's training passes only: GAE's value pass over the batch is not recorded
        check_tanh_saturation(rec, "critic_mlp.1", torch.cat(cap.out["critic_mlp.1"][window]))
        layers = [
            (cap.inp[f"actor_mlp.{i}"][window], cap.grad[f"actor_mlp.{i}"][window])
            for i in (0, 2, 4)
        ]
        ref = fisher_reference(cap.grad["actor_mlp"][window], layers)
        assert rec["probes/fisher/actor_mlp/trace"] == pytest.approx(ref["trace"], rel=1e-6)
        for key in ("loss_objective", "loss_critic", "loss_entropy", "clip_fraction"):
            # the session sums the float32 scalars: float32 rounding of a mean near zero
            mean = float(torch.stack([step[key] for step in losses[window]]).double().mean())
            assert rec[f"train/{key}"] == pytest.approx(mean, rel=1e-5, abs=1e-6)
        assert not any(k.startswith("probes/errors/") for k in rec)


def test_trainer_checkpoint_carries_the_session(tmp_path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    actor, critic, _ = make_agent(0)
    trainer = make_trainer(
        actor, critic, total_frames=2 * FRAMES, checkpoint=Checkpoint(), save_trainer_file=ckpt
    )
    with make_session(actor, critic, Run(run_dir)) as session:
        ProbeTrainerHook(session).register(trainer)
        trainer.train()  # saves the checkpoint when its frames are done

    # a fresh trainer and session (probes attached), restored from the trainer's checkpoint
    actor, critic, mlp = make_agent(1)
    trainer = make_trainer(
        actor, critic, total_frames=3 * FRAMES, checkpoint=Checkpoint(), save_trainer_file=ckpt
    )
    with make_session(actor, critic, Run(run_dir, resume=True)) as session:
        hook = ProbeTrainerHook(session)
        hook.register(trainer)
        trainer.load_from_file(ckpt)
        assert session.epoch == 2 and session.optimizer_step == 2 * STEPS
        cap = Capture({"actor_mlp.1": mlp[1]}, {})
        trainer.train()
        cap.remove()
        assert session.optimizer_step == 3 * STEPS

    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r["agent_step"] for r in records] == [FRAMES, 2 * FRAMES, 3 * FRAMES]
    # the restored record holds the restored trainer's passes only
    h = torch.cat(cap.out["actor_mlp.1"])
    assert h.shape[0] == records[2]["probes/relu/actor_mlp.1/samples"] == EPOCHS * FRAMES
    active = (h > 0).double().mean(0)
    assert records[2]["probes/relu/actor_mlp.1/dead_fraction"] == float(
        (active == 0).double().mean()
    )
