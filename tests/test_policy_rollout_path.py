"""The policy's rollout fast path: the stacked actor-critic forward reproduces the module
path bit for bit (or is not used), and inverse-CDF categorical sampling draws each action
with its probability."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from trainers.config import PolicyConfig
from trainers.policy import ActorCriticPolicy, StackedMLPs

torch.set_num_threads(1)


def make_policy(obs_dim: int = 4, n_actions: int | None = 2, **cfg) -> ActorCriticPolicy:
    box = gym.spaces.Box(-1, 1, (obs_dim,), np.float32)
    actions = (
        gym.spaces.Discrete(n_actions)
        if n_actions is not None
        else gym.spaces.Box(-1, 1, (2,), np.float32)
    )
    return ActorCriticPolicy(box, actions, PolicyConfig(**cfg))


def randomize(policy: ActorCriticPolicy) -> None:
    """Non-zero biases and a non-degenerate head, so every parameter shapes the output."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)


@pytest.mark.parametrize(
    ("obs_dim", "n_actions", "hidden", "activation", "batch"),
    [
        (4, 2, [64, 64], "tanh", 4),  # the throughput benchmark (CartPole, 4 envs)
        (4, 2, [64, 64], "relu", 4),
        (4, 2, [64, 64], "tanh", 1),
        (4, 2, [64, 64], "tanh", 16),
        (8, 3, [64, 64, 64], "elu", 8),
        (3, None, [64, 64], "tanh", 4),  # Gaussian policy (Pendulum)
    ],
)
def test_rollout_forward_reproduces_the_module_path(obs_dim, n_actions, hidden, activation, batch):
    torch.manual_seed(0)
    policy = make_policy(obs_dim, n_actions, hidden_sizes=hidden, activation=activation)
    randomize(policy)
    with torch.inference_mode():
        forward = policy.rollout_forward(torch.randn(batch, obs_dim))
        # equal layer sizes and activations: the stacked network is used on this machine
        assert isinstance(forward, StackedMLPs)
        for _ in range(50):
            x = torch.randn(batch, obs_dim) * 3
            out, value = forward(x)
            ref_out, ref_value = policy(x)  # nn.Module.__call__ on every layer
            assert torch.equal(out, ref_out)
            assert torch.equal(value, ref_value)


def test_act_is_identical_on_the_fast_and_the_module_path():
    torch.manual_seed(1)
    policy = make_policy(hidden_sizes=[64, 64], activation="tanh")
    randomize(policy)
    x = torch.randn(4, 4)
    with torch.inference_mode():
        fast = policy.act(x, torch.Generator().manual_seed(3), forward=policy.rollout_forward(x))
        slow = policy.act(x, torch.Generator().manual_seed(3))
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def test_different_mlps_are_not_stacked():
    policy = make_policy(hidden_sizes=[64, 64], critic_hidden_sizes=[32, 32])
    assert StackedMLPs.build(policy) is None
    mixed = make_policy(hidden_sizes=[64, 64], activation="tanh", critic_activation="relu")
    assert StackedMLPs.build(mixed) is None
    with torch.inference_mode():
        forward = policy.rollout_forward(torch.zeros(4, 4))
    assert forward == policy._forward_direct


def test_a_stacked_network_that_rounds_differently_is_not_used(monkeypatch):
    """The guard: when the stacked products do not reproduce the module path exactly on
    the rollout's shapes (BLAS kernels differ), rollout_forward keeps the per-layer path."""
    policy = make_policy(hidden_sizes=[64, 64])
    randomize(policy)
    call = StackedMLPs.__call__

    def off_by_one_ulp(self, obs):
        out, value = call(self, obs)
        return out, torch.nextafter(value, torch.full_like(value, np.inf))

    monkeypatch.setattr(StackedMLPs, "__call__", off_by_one_ulp)
    with torch.inference_mode():
        forward = policy.rollout_forward(torch.randn(4, 4))
    assert forward == policy._forward_direct


def test_not_stacked_off_the_cpu():
    policy = make_policy(hidden_sizes=[8])
    with torch.inference_mode():
        forward = policy.rollout_forward(torch.zeros(2, 4, device="meta"))
    assert forward == policy._forward_direct


def test_inverse_cdf_sampling_draws_each_action_with_its_probability():
    probs = torch.tensor(
        [
            [0.1, 0.2, 0.7, 0.0],
            [0.25, 0.25, 0.25, 0.25],
            [0.0, 0.999, 0.0005, 0.0005],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    draws = 50_000
    logits = probs.log().repeat(draws, 1)  # zero probabilities are -inf logits
    policy = make_policy(obs_dim=4, n_actions=4, hidden_sizes=[8])
    value = torch.zeros(logits.shape[0])
    with torch.inference_mode():
        action, logprob, _ = policy.act(
            torch.zeros(logits.shape[0], 4),
            torch.Generator().manual_seed(0),
            forward=lambda obs: (logits, value),
        )
    assert action.dtype == torch.long and action.shape == (logits.shape[0],)
    # the log-probability returned is that of the action drawn
    torch.testing.assert_close(
        logprob, torch.log_softmax(logits, -1).gather(1, action[:, None])[:, 0]
    )
    counts = torch.zeros(4, 4)
    rows = torch.arange(logits.shape[0]) % 4
    counts.index_put_((rows, action), torch.ones(logits.shape[0]), accumulate=True)
    # never an action of probability zero
    assert (counts[probs == 0] == 0).all()
    # chi-square goodness of fit per row over the actions with p > 0: below the 0.1 %
    # critical value of its degrees of freedom (1, 2 or 3); a sampler off by one
    # percentage point on the first row alone would give a statistic above 50
    critical = {1: 10.83, 2: 13.82, 3: 16.27}
    for row in range(3):
        p = probs[row][probs[row] > 0].double()
        observed = counts[row][probs[row] > 0].double()
        expected = p * draws
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < critical[p.numel() - 1], (row, observed, expected)
    assert counts[3, 3] == draws


def test_sampling_uses_only_the_given_generator():
    policy = make_policy(hidden_sizes=[8])
    x = torch.randn(64, 4)
    torch.manual_seed(0)
    a = policy.act(x, torch.Generator().manual_seed(5))[0]
    torch.manual_seed(123)  # the global RNG does not matter
    b = policy.act(x, torch.Generator().manual_seed(5))[0]
    c = policy.act(x, torch.Generator().manual_seed(6))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
