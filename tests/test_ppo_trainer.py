"""PPO trainer: autoreset handling and GAE against a hand-written reference, losses,
action distributions, gradient accumulation."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.wrappers import vector as vw

from trainers import ActorCriticPolicy, PolicyConfig, PPOConfig, PPOTrainer
from trainers.ppo import LOSS_STATS, ppo_loss
from trainers.rollout import Minibatch

torch.set_num_threads(1)


class BoundaryEnv(gym.Env):
    """Deterministic episodes of fixed length that end by termination or truncation.

    Observation ``[t, episode, env_id]``; reward at step t (1-based) is ``t + 10 * env_id``;
    the action is ignored.
    """

    def __init__(self, env_id: int, length: int, mode: str) -> None:
        self.env_id, self.length, self.mode = env_id, length, mode
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t, self.episode = 0, -1

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.episode, self.env_id], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.episode = 0, self.episode + 1
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        end = self.t >= self.length
        reward = float(self.t + 10 * self.env_id)
        return (
            self._obs(),
            reward,
            end and self.mode == "terminate",
            end and self.mode == "truncate",
            {},
        )


SPECS = [(0, 3, "terminate"), (1, 5, "truncate"), (2, 100, "terminate")]
T = 12


def make_boundary_envs() -> gym.vector.VectorEnv:
    fns = [lambda i=i, n=n, m=m: BoundaryEnv(i, n, m) for i, n, m in SPECS]
    return vw.RecordEpisodeStatistics(gym.vector.SyncVectorEnv(fns))


def expected_rollout(env_id: int, length: int, mode: str):
    """Simulate NEXT_STEP autoreset by hand: per storage step the stored observation,
    whether it is a real transition, and for real ones (reward, next obs, terminated, truncated)."""
    t, ep, pending_reset = 0, 0, False
    out = []
    for _ in range(T):
        obs = [t, ep, env_id]
        if pending_reset:  # the autoreset step: action ignored, returns the reset obs
            t, ep, pending_reset = 0, ep + 1, False
            out.append((obs, False, None))
            continue
        t += 1
        end = t >= length
        out.append(
            (
                obs,
                True,
                (
                    float(t + 10 * env_id),
                    [t, ep, env_id],
                    end and mode == "terminate",
                    end and mode == "truncate",
                ),
            )
        )
        pending_reset = end
    return out, [t, ep, env_id]


def reference_advantages(policy, gamma: float, lam: float):
    """GAE per episode from the definition: A_t = sum_k (gamma lam)^k delta_{t+k} over the
    remaining transitions of the same episode inside the rollout."""
    adv = np.zeros((T, len(SPECS)))
    valid = np.zeros((T, len(SPECS)), dtype=bool)
    obs_expected = np.zeros((T, len(SPECS), 3), dtype=np.float32)

    device = next(policy.parameters()).device

    def V(o):
        with torch.no_grad():
            return float(policy.value(torch.tensor([o], dtype=torch.float32).to(device))[0])

    for i, spec in enumerate(SPECS):
        steps, _last_obs = expected_rollout(*spec)
        deltas: list[tuple[int, float, bool]] = []  # (t, delta, episode ends here)
        for t, (obs, is_valid, tr) in enumerate(steps):
            obs_expected[t, i] = obs
            valid[t, i] = is_valid
            if not is_valid:
                continue
            reward, next_obs, term, trunc = tr
            bootstrap = 0.0 if term else V(next_obs)  # truncation bootstraps V(final obs)
            deltas.append((t, reward + gamma * bootstrap - V(obs), term or trunc))
        # split into episode segments and sum discounted deltas within each
        segment: list[tuple[int, float]] = []
        segments = []
        for t, d, ends in deltas:
            segment.append((t, d))
            if ends:
                segments.append(segment)
                segment = []
        if segment:
            segments.append(segment)
        for seg in segments:
            for k, (t, _) in enumerate(seg):
                adv[t, i] = sum((gamma * lam) ** j * d for j, (_, d) in enumerate(seg[k:]))
    return adv, valid, obs_expected


def make_trainer(
    envs, cfg: PPOConfig, hidden=(8,), seed=0, device: torch.device | str = "cpu", **kw
) -> PPOTrainer:
    """A trainer whose policy is built on the CPU from ``seed``, then moved to ``device``,
    where the trainer runs."""
    torch.manual_seed(seed)
    policy = ActorCriticPolicy(
        envs.single_observation_space,
        envs.single_action_space,
        PolicyConfig(hidden_sizes=list(hidden)),
    ).to(device)
    return PPOTrainer(envs, policy, cfg, seed=seed, device=device, **kw)


#: discount and GAE lambda of the boundary rollouts, far from 1 so that every term counts
GAMMA, LAM = 0.9, 0.8


def boundary_rollout(device: torch.device | str = "cpu", **cfg: object) -> PPOTrainer:
    """A trainer on :func:`make_boundary_envs` (``trainer.envs``; close them) that has
    collected one rollout of ``T`` steps, discounted with ``GAMMA`` and ``LAM``, on
    ``device``."""
    cfg = dict(total_timesteps=T * 3, num_steps=T, gamma=GAMMA, gae_lambda=LAM, **cfg)
    trainer = make_trainer(make_boundary_envs(), PPOConfig(**cfg), device=device)
    trainer.reset_envs()
    trainer.collect_rollout()
    return trainer


def test_autoreset_transitions_masked_and_gae_matches_reference(device):
    trainer = boundary_rollout(device, num_minibatches=2)
    st = trainer.storage
    ref_adv, ref_valid, ref_obs = reference_advantages(trainer.policy, GAMMA, LAM)

    np.testing.assert_array_equal(st.obs.cpu().numpy(), ref_obs)
    np.testing.assert_array_equal(st.valid, ref_valid)
    # the autoreset steps are excluded from the minibatches
    expected_idx = np.flatnonzero(ref_valid.reshape(-1))
    np.testing.assert_array_equal(st.valid_indices.cpu().numpy(), expected_idx)
    order = st.shuffled_order(torch.Generator().manual_seed(0))
    assert sorted(order.cpu().tolist()) == expected_idx.tolist()
    assert sum(len(mb) for mb in st.minibatches(order, 2)) == expected_idx.size
    # env 0 terminates at t=2 and 6 (autoreset at 3, 7, 11); env 1 truncates at 4 (autoreset 5, 11)
    assert not ref_valid[3, 0] and not ref_valid[5, 1] and ref_valid[:, 2].all()
    np.testing.assert_allclose(
        st.advantages.cpu().numpy()[ref_valid], ref_adv[ref_valid], rtol=1e-5, atol=1e-5
    )
    assert (st.advantages.cpu().numpy()[~ref_valid] == 0).all()
    np.testing.assert_allclose(
        st.returns.cpu().numpy()[ref_valid],
        (ref_adv + st.values.cpu().numpy())[ref_valid],
        rtol=1e-5,
        atol=1e-5,
    )
    # episode statistics come from RecordEpisodeStatistics: env 0 episodes return 1+2+3
    assert trainer.state.rollout_stats["episode_return_min"] == 6.0
    trainer.envs.close()


def test_categorical_and_gaussian_match_torch_distributions(device):
    torch.manual_seed(0)
    box = gym.spaces.Box(-1, 1, (3,), np.float32)
    obs = torch.randn(7, 3)
    disc = ActorCriticPolicy(box, gym.spaces.Discrete(4), PolicyConfig(hidden_sizes=[5]))
    # built and drawn on the CPU as before, then moved; act() samples from a generator
    # on the policy's device, as the trainer's own is
    obs, disc = obs.to(device), disc.to(device)
    a, logp, v = disc.act(obs, torch.Generator(device=device).manual_seed(1))
    logits, value = disc(obs)
    ref = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(logp, ref.log_prob(a))
    lp2, ent, v2 = disc.evaluate_actions(obs, a)
    torch.testing.assert_close(lp2, ref.log_prob(a))
    torch.testing.assert_close(ent, ref.entropy())
    torch.testing.assert_close(v, value)

    cont = ActorCriticPolicy(
        box,
        gym.spaces.Box(-2, 2, (2,), np.float32),
        PolicyConfig(hidden_sizes=[5], init_log_std=-0.5),
    ).to(device)
    a, logp, _ = cont.act(obs, torch.Generator(device=device).manual_seed(1))
    mean, _ = cont(obs)
    ref = torch.distributions.Normal(mean, cont.log_std.exp())
    torch.testing.assert_close(logp, ref.log_prob(a).sum(-1))
    lp2, ent, _ = cont.evaluate_actions(obs, a)
    torch.testing.assert_close(lp2, ref.log_prob(a).sum(-1))
    torch.testing.assert_close(ent, ref.entropy().sum(-1))
    torch.testing.assert_close(cont.deterministic_action(obs), mean)


def test_orthogonal_init(device):
    box = gym.spaces.Box(-1, 1, (4,), np.float32)
    p = ActorCriticPolicy(box, gym.spaces.Discrete(2), PolicyConfig(hidden_sizes=[16, 16]))
    p = p.to(device)
    w = p.actor_mlp.layer_1.linear.weight
    torch.testing.assert_close(w @ w.T, 2.0 * torch.eye(16).to(device), atol=1e-5, rtol=1e-5)
    h = p.actor_head.weight  # (2, 16): orthonormal rows scaled by 0.01
    torch.testing.assert_close(h @ h.T, 1e-4 * torch.eye(2).to(device), atol=1e-9, rtol=1e-5)
    c = p.critic_head.weight
    torch.testing.assert_close((c @ c.T).squeeze(), torch.tensor(1.0).to(device))
    assert all((m.bias == 0).all() for m in p.modules() if isinstance(m, torch.nn.Linear))


def test_ppo_loss_matches_formula(device):
    torch.manual_seed(0)
    box = gym.spaces.Box(-1, 1, (3,), np.float32)
    pol = ActorCriticPolicy(box, gym.spaces.Discrete(3), PolicyConfig(hidden_sizes=[6]))
    n = 16
    obs = torch.randn(n, 3)
    actions = torch.randint(0, 3, (n,))
    old_logp = torch.randn(n) * 0.3 - 1.1
    values, adv, ret = torch.randn(n), torch.randn(n), torch.randn(n)
    pol = pol.to(device)
    obs, actions, old_logp = obs.to(device), actions.to(device), old_logp.to(device)
    values, adv, ret = values.to(device), adv.to(device), ret.to(device)
    cfg = PPOConfig(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5)
    loss, stats = ppo_loss(pol, Minibatch(obs, actions, old_logp, values, adv, ret), cfg)

    with torch.no_grad():
        logits, newv = pol(obs)
    dist = torch.distributions.Categorical(logits=logits)
    ratio = torch.exp(dist.log_prob(actions) - old_logp)
    pg = torch.mean(torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)))
    vclip = values + (newv - values).clamp(-0.2, 0.2)
    vl = 0.5 * torch.mean(torch.maximum((newv - ret) ** 2, (vclip - ret) ** 2))
    ent = dist.entropy().mean()
    torch.testing.assert_close(loss.detach(), pg - 0.01 * ent + 0.5 * vl)
    got = dict(zip(LOSS_STATS, stats.cpu().tolist(), strict=True))
    assert got["policy_loss"] == pytest.approx(float(pg), rel=1e-5)
    assert got["value_loss"] == pytest.approx(float(vl), rel=1e-5)
    assert got["entropy"] == pytest.approx(float(ent), rel=1e-5)
    logr = dist.log_prob(actions) - old_logp
    assert got["approx_kl"] == pytest.approx(float(((ratio - 1) - logr).mean()), rel=1e-5)
    assert got["old_approx_kl"] == pytest.approx(float((-logr).mean()), rel=1e-5)
    assert got["clipfrac"] == pytest.approx(float(((ratio - 1).abs() > 0.2).float().mean()))


def test_micro_batches_accumulate_the_same_gradient_and_set_loss_scale(device):
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    envs = vw.RecordEpisodeStatistics(envs)
    base = PPOConfig(total_timesteps=128, num_steps=64, num_minibatches=1, max_grad_norm=None)
    trainer = make_trainer(envs, base, hidden=(8,), device=device)
    ctx = trainer.context
    trainer.reset_envs()
    trainer.collect_rollout()
    batch = trainer.storage.gather(trainer.storage.valid_indices)

    def grads_with(k: int) -> tuple[list[torch.Tensor], list[float]]:
        t2 = copy.copy(trainer)
        t2.policy = copy.deepcopy(trainer.policy)
        t2.cfg = base.model_copy(update={"micro_batches": k})
        t2.optimizer = torch.optim.SGD(t2.policy.parameters(), lr=0.0)
        scales: list[float] = []
        handle = t2.policy.critic_head.register_forward_hook(
            lambda *a: scales.append(ctx.loss_scale)
        )
        t2.train_minibatch(batch)
        handle.remove()
        return [p.grad.clone() for p in t2.policy.parameters()], scales

    g1, s1 = grads_with(1)
    g3, s3 = grads_with(3)
    for a, b in zip(g1, g3, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    n = len(batch)
    assert s1 == [1.0]
    assert s3 == pytest.approx([len(p) / n for p in torch.tensor_split(torch.arange(n), 3)])
    assert ctx.loss_scale == 1.0
    envs.close()


def test_learning_rate_anneals_linearly_and_phases(device):
    envs = vw.RecordEpisodeStatistics(
        gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    )
    cfg = PPOConfig(
        total_timesteps=4 * 64, num_steps=32, num_minibatches=2, update_epochs=1, learning_rate=1e-3
    )
    trainer = make_trainer(envs, cfg, device=device)
    lrs, phases = [], []
    from trainers import TrainerHook

    class Watch(TrainerHook):
        def on_rollout_end(self, s):
            phases.append(s.context.phase)

        def on_mb_end(self, s):
            phases.append(s.context.phase)

        def on_train_phase_end(self, s):
            lrs.append(s.loss_stats["learning_rate"])

    trainer.hooks.append(Watch())
    trainer.train()
    assert lrs == pytest.approx([1e-3 * (1 - i / 4) for i in range(4)])
    assert set(phases[::3]) == {"rollout"} and set(phases[1::3]) | set(phases[2::3]) == {"train"}
    assert math.isfinite(trainer.state.loss_stats["explained_variance"])
    envs.close()


@pytest.mark.parametrize("mode", ["sync", "async", "vector_entry_point"])
def test_vectorization_modes(mode, tmp_path, device):
    from trainers import EnvConfig
    from trainers.envs import make_vector_env

    envs = make_vector_env(EnvConfig(id="CartPole-v1", num_envs=2, vectorization=mode))
    cfg = PPOConfig(total_timesteps=64, num_steps=32, num_minibatches=2, update_epochs=1)
    trainer = make_trainer(envs, cfg, device=device)
    state = trainer.train()
    assert state.agent_step == 64
    envs.close()


def test_vector_entry_point_missing_is_clear():
    from trainers import EnvConfig
    from trainers.envs import make_vector_env

    with pytest.raises(ValueError, match="no vector_entry_point"):
        make_vector_env(EnvConfig(id="Pendulum-v1", vectorization="vector_entry_point"))


def test_minibatches_are_the_gathered_rows_in_order(device):
    """Gathering the rollout once in ``order`` and slicing gives exactly the minibatches
    of gathering each one's indices."""
    trainer = boundary_rollout(device)
    st = trainer.storage
    order = st.shuffled_order(torch.Generator().manual_seed(3))
    for k in (1, 3, 4):
        got = list(st.minibatches(order, k))
        want = [st.gather(idx) for idx in torch.tensor_split(order, k)]
        assert len(got) == len(want) == k
        for a, b in zip(got, want, strict=True):
            for f in ("obs", "actions", "logprobs", "values", "advantages", "returns"):
                assert torch.equal(getattr(a, f), getattr(b, f)), f
    trainer.envs.close()


@pytest.mark.parametrize("max_grad_norm", [0.05, 1e6, None])
def test_clip_and_step_clips_exactly_like_clip_grad_norm(max_grad_norm, device):
    envs = make_boundary_envs()
    cfg = PPOConfig(total_timesteps=T * 3, num_steps=T, max_grad_norm=max_grad_norm)
    trainer = make_trainer(envs, cfg, hidden=(16, 16), device=device)
    reference = copy.deepcopy(trainer.policy)
    torch.manual_seed(0)
    for p, q in zip(trainer.policy.parameters(), reference.parameters(), strict=True):
        p.grad = torch.randn_like(p, device="cpu").to(p.device)  # the CPU draws, moved
        q.grad = p.grad.clone()
    norm = trainer.clip_and_step(step=False)
    want = torch.nn.utils.clip_grad_norm_(
        list(reference.parameters()), max_grad_norm if max_grad_norm is not None else math.inf
    )
    assert torch.equal(norm, want)
    for p, q in zip(trainer.policy.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    # the returned norm is that of all gradients as one vector; after clipping it is at
    # most max_grad_norm
    flat = torch.cat([p.grad.flatten() for p in trainer.policy.parameters()])
    if max_grad_norm is None or max_grad_norm > float(norm):
        torch.testing.assert_close(flat.norm(), norm)
    else:
        torch.testing.assert_close(
            flat.norm(), torch.tensor(max_grad_norm).to(device), rtol=1e-5, atol=0
        )
    envs.close()
