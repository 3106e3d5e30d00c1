"""Churn probe (C-CHAIN, Tang et al. 2025): policy KL and |dV| on held-out states before
and after an epoch's updates, against a copy of the policy taken before the updates and
the formulas written out with loops; the trainer's trajectory is unchanged by it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_ppo_trainer import T, make_boundary_envs

from policy_probes import (
    ComponentContext,
    LinearSpec,
    PolicyAutoBuilder,
    ProbeSettings,
    Run,
    StatsReporter,
)
from policy_probes.probes.churn import Churn, attach_churn_hooks
from trainers import ActorCriticPolicy, PolicyConfig, PPOConfig, PPOTrainer


class Heads(PolicyAutoBuilder):
    def __init__(self) -> None:
        super().__init__(
            {
                "actor_head": LinearSpec(in_features=4, out_features=3),
                "critic_head": LinearSpec(in_features=4, out_features=1),
            }
        )

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor_head(obs), self.critic_head(obs)


def kl_by_loops(p_logits: torch.Tensor, q_logits: torch.Tensor) -> list[float]:
    out = []
    for lp, lq in zip(p_logits.cpu().tolist(), q_logits.cpu().tolist(), strict=True):
        zp = math.log(sum(math.exp(v) for v in lp))
        zq = math.log(sum(math.exp(v) for v in lq))
        out.append(
            sum(math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in zip(lp, lq, strict=True))
        )
    return out


def held_out_rows(obs: torch.Tensor, n: int) -> torch.Tensor:
    """n rows evenly spaced from the first to the last (rounded down)."""
    rows = obs.shape[0]
    return obs[[int(i * (rows - 1) / (n - 1)) for i in range(n)]]


def train_some(
    policy: Heads, steps: int, seed: int, device: torch.device = torch.device("cpu")
) -> None:
    """SGD steps on inputs drawn on the CPU (the same on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(policy.parameters(), lr=0.3)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g).to(device)
        logits, v = policy(x)
        opt.zero_grad()
        (logits[:, 0].mean() + v.square().mean()).backward()
        opt.step()


def test_kl_and_value_change_per_epoch_on_the_previous_rollouts_states(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    policy = Heads().to(device)
    ctx = ComponentContext()
    policy.attach("actor_head", attach_churn_hooks(kind="categorical", batch_size=5), ctx)
    policy.attach("critic_head", attach_churn_hooks(batch_size=5), ctx)
    rollouts = [torch.randn(23, 4).to(device), torch.randn(17, 4).to(device)]
    batches = [held_out_rows(rollouts[0], 5), held_out_rows(rollouts[0], 5)]  # epoch 2: epoch 1's
    for epoch, obs in enumerate(rollouts):
        before = copy.deepcopy(policy)
        rng = torch.get_rng_state()
        ctx.model_metrics["churn"].rollout_end(obs, policy)
        assert torch.equal(torch.get_rng_state(), rng)  # the trajectory's RNG is untouched
        train_some(policy, 3, epoch, device)
        got = StatsReporter(ctx).collect()
        with torch.no_grad():
            lb, vb = before(batches[epoch])
            la, va = policy(batches[epoch])
        kl = kl_by_loops(lb, la)
        dv = [
            abs(a - b)
            for a, b in zip(
                va.reshape(-1).cpu().tolist(), vb.reshape(-1).cpu().tolist(), strict=True
            )
        ]
        dl = [
            sum(abs(a - b) for a, b in zip(ra, rb, strict=True)) / 3
            for ra, rb in zip(la.cpu().tolist(), lb.cpu().tolist(), strict=True)
        ]
        assert got["probes/churn/actor_head/policy_kl"] == pytest.approx(sum(kl) / 5, rel=1e-6)
        assert got["probes/churn/actor_head/policy_kl_max"] == pytest.approx(max(kl), rel=1e-6)
        assert got["probes/churn/actor_head/output_change"] == pytest.approx(sum(dl) / 5, rel=1e-6)
        assert got["probes/churn/critic_head/value_change"] == pytest.approx(sum(dv) / 5, rel=1e-6)
        assert got["probes/churn/critic_head/value_change_max"] == pytest.approx(max(dv), rel=1e-6)
        assert got["probes/churn/critic_head/states"] == 5.0
        assert got["probes/churn/actor_head/policy_kl"] > 0


def test_a_fixed_batch_and_a_checkpoint_in_the_middle_of_an_epoch(device: torch.device) -> None:
    torch.manual_seed(1)
    policy = Heads().to(device)
    ctx = ComponentContext()
    policy.attach("critic_head", attach_churn_hooks(), ctx)
    fixed = torch.randn(6, 4).to(device)
    tracker = ctx.model_metrics["churn"]
    assert isinstance(tracker, Churn)
    tracker.fix_batch(fixed)
    before = copy.deepcopy(policy)
    # the rollout is not used: the batch is fixed
    ctx.model_metrics["churn"].rollout_end(torch.randn(30, 4).to(device), policy)
    saved = tracker.state_dict()
    # resumed in the middle of the epoch: a fresh context loads the saved state
    ctx2 = ComponentContext()
    policy.attach("critic_head", attach_churn_hooks(), ctx2)
    ctx2.model_metrics["churn"].load_state_dict(saved)  # the attached policy runs the forwards
    train_some(policy, 2, 5, device)
    got = StatsReporter(ctx2).collect()
    with torch.no_grad():
        dv = (policy(fixed)[1] - before(fixed)[1]).abs().reshape(-1).cpu().tolist()
    assert got["probes/churn/critic_head/value_change"] == pytest.approx(sum(dv) / 6, rel=1e-6)
    with pytest.raises(ValueError, match="kind"):
        attach_churn_hooks(kind="kl")


def test_a_checkpoint_loaded_on_the_cpu_puts_the_held_out_state_on_the_models_device() -> None:
    """Checkpoints are loaded to the CPU and each tracker is given the model's device: the
    held-out batch, the outputs before the updates and the running maxima go there with
    the sums. The meta device stands in for an accelerator (every machine has it)."""
    torch.manual_seed(1)
    policy = Heads()
    ctx = ComponentContext()
    policy.attach("actor_head", attach_churn_hooks(kind="categorical"), ctx)
    tracker = ctx.model_metrics["churn"]
    tracker.fix_batch(torch.randn(6, 4))
    ctx.model_metrics["churn"].rollout_end(torch.randn(30, 4), policy)
    train_some(policy, 1, 5)
    tracker.end_epoch()  # one epoch compared: maxima exist
    ctx.model_metrics["churn"].rollout_end(
        torch.randn(30, 4), policy
    )  # the next epoch's outputs before its updates
    saved = tracker.state_dict()
    loaded = Churn()
    loaded.register_component("actor_head", kind="categorical")
    loaded.load_state_dict(saved, device=torch.device("meta"))
    held = [loaded.fixed, loaded.batch, *loaded.before.values()]
    held += [m for maxima in loaded.maxima.values() for m in maxima.values()]
    assert len(held) == 5  # fixed, batch, one output, the KL's and the change's maxima
    assert all(t.device.type == "meta" for t in held)
    assert all(t.device.type == "meta" for t in loaded.state["actor_head"].values())


def run_trainer(
    churn: bool, device: torch.device = torch.device("cpu")
) -> tuple[dict, list[torch.Tensor]]:
    envs = make_boundary_envs()
    cfg = PPOConfig(total_timesteps=T * 3 * 2, num_steps=T, num_minibatches=2)
    # test_ppo_trainer.make_trainer's policy and trainer, the policy moved to ``device``
    # (built on the CPU with the same seed) before the trainer takes it
    torch.manual_seed(0)
    policy = ActorCriticPolicy(
        envs.single_observation_space, envs.single_action_space, PolicyConfig(hidden_sizes=[8])
    ).to(device)
    trainer = PPOTrainer(envs, policy, cfg, seed=0, device=device)
    if churn:
        trainer.session.add_training_hook("actor_head", attach_churn_hooks(kind="categorical"))
        trainer.session.add_training_hook("critic_head", attach_churn_hooks())
    state = trainer.train()
    envs.close()
    return state.metrics, [p.detach().clone() for p in trainer.policy.parameters()]


def test_the_trainer_reports_churn_without_changing_its_trajectory(device: torch.device) -> None:
    with_churn, params = run_trainer(True, device)
    without, params0 = run_trainer(False, device)
    assert all(torch.equal(a, b) for a, b in zip(params, params0, strict=True))
    assert with_churn["probes/churn/actor_head/policy_kl"] > 0
    assert with_churn["probes/churn/critic_head/value_change"] > 0
    assert with_churn["train/policy_loss"] == without["train/policy_loss"]


def test_sb3_callback_takes_the_held_out_states_from_the_rollout_buffer(tmp_path) -> None:
    from test_sb3_callback import ROWS, ppo

    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.sinks import SinksConfig

    plain = ppo(seed=3)
    plain.learn(3 * ROWS)
    model = ppo(seed=3)
    callback = ProbeCallback(
        probes=[
            ("action_net", attach_churn_hooks(kind="categorical", batch_size=32)),
            ("value_net", attach_churn_hooks(batch_size=32)),
        ],
        run_dir=tmp_path,
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False), probe_budget=None),
    )
    model.learn(3 * ROWS, callback=callback)
    for record in callback.history:
        assert record["probes/churn/action_net/policy_kl"] > 0
        assert record["probes/churn/value_net/value_change"] > 0
        assert record["probes/churn/value_net/states"] == 32
    a, b = plain.policy.state_dict(), model.policy.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the trajectory is unchanged


def test_probe_session_rollout_end_hands_the_observations_over(
    tmp_path, device: torch.device
) -> None:
    from policy_probes import ProbeSession
    from policy_probes.sinks import SinksConfig

    torch.manual_seed(4)
    policy = Heads().to(device)
    session = ProbeSession(
        policy,
        run=Run(tmp_path),
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False), probe_budget=None),
    )
    session.add_training_hook("critic_head", attach_churn_hooks(batch_size=4))
    obs = torch.randn(12, 4).to(device)
    before = copy.deepcopy(policy)
    session.set_phase("rollout")
    session.rollout_end(observations=obs)
    session.set_phase("train")
    train_some(policy, 2, 9, device)
    got = session.epoch_end(step=12)
    session.close()
    batch = held_out_rows(obs, 4)
    with torch.no_grad():
        dv = (policy(batch)[1] - before(batch)[1]).abs().reshape(-1).cpu().tolist()
    assert got["probes/churn/critic_head/value_change"] == pytest.approx(sum(dv) / 4, rel=1e-6)
