"""ProbeCallback on Stable-Baselines3 PPO("CnnPolicy") (NatureCNN on pixels): the relu,
gradient-flow, ReLU gradient-flow and Fisher probes on the CNN encoder and the heads, per layer and per
channel, every metric of every cycle checked against plain torch hooks registered by the
test and per-sample gradients formed independently (``torch.nn.grad.conv2d_weight`` on
one sample at a time, not the probe's im2col rule)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from torch import nn

from policy_probes import (
    ProbeSettings,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
)
from policy_probes.integrations.sb3 import ProbeCallback
from policy_probes.records import read_jsonl
from policy_probes.sinks import SinksConfig, WandbConfig

N_ENVS, N_STEPS, BATCH, N_EPOCHS, CYCLES = 2, 32, 32, 2, 2
ROWS = N_ENVS * N_STEPS
CALLS = N_EPOCHS * ROWS // BATCH  # train() forwards per cycle
BETA = 0.95
REL = 1e-6


class Pixels(gym.Env):
    """Random 40x40 grayscale frames (NatureCNN's smallest input is 36x36); the reward
    depends on the action and the frame, so the policy has something to fit."""

    observation_space = gym.spaces.Box(0, 255, (40, 40, 1), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._frame(), {}

    def _frame(self) -> np.ndarray:
        self.frame = self.np_random.integers(0, 256, (40, 40, 1), dtype=np.uint8)
        return self.frame

    def step(self, action):
        reward = float(action == int(self.frame.mean()) % 3)
        self.t += 1
        return self._frame(), reward, self.t >= 20, False, {}


class Capture:
    """Plain hooks: each ReLU's output, and each conv/linear layer's input and output
    gradient, for the forwards of train() (the rollout runs under no_grad)."""

    def __init__(self, relus: dict[str, nn.Module], layers: dict[str, nn.Module]) -> None:
        self.out: dict[str, list[torch.Tensor]] = {k: [] for k in relus}
        self.inp: dict[str, list[torch.Tensor]] = {k: [] for k in layers}
        self.grad: dict[str, list[torch.Tensor]] = {k: [] for k in [*relus, *layers]}
        self.handles = [m.register_forward_hook(self._hook(k, False)) for k, m in relus.items()]
        self.handles += [m.register_forward_hook(self._hook(k, True)) for k, m in layers.items()]

    def _hook(self, name: str, keep_input: bool):
        def hook(_m, inputs, out):
            if not torch.is_grad_enabled():
                return
            if keep_input:
                self.inp[name].append(inputs[0].detach().clone())
            else:
                self.out[name].append(out.detach().clone())
            out.register_hook(lambda g: self.grad[name].append(g.detach().clone()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def per_channel(t: torch.Tensor) -> torch.Tensor:
    """(B, C, ...) -> (elements, C): every (sample, position) a row."""
    return t.movedim(1, -1).reshape(-1, t.shape[1]) if t.dim() > 2 else t


def relu_expected(outs: list[torch.Tensor]) -> dict[str, object]:
    rows = per_channel(torch.cat(outs)).double()
    active = (rows > 0).double().mean(0)
    return {
        "active_rate": active.tolist(),
        "dead_fraction": float((active == 0).double().mean()),
        "zero_fraction": float((rows <= 0).double().mean()),
        "samples": float(sum(o.shape[0] for o in outs)),
    }


def gradient_rms_expected(grads: list[torch.Tensor]) -> list[float]:
    m = torch.zeros(per_channel(grads[0]).shape[1], dtype=torch.float64)
    for g in grads:
        m = BETA * m + (1 - BETA) * per_channel(g).double().square().mean(0).sqrt()
    return (m / (1 - BETA ** len(grads))).tolist()


def per_sample_grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients of the layer's weight and bias for the minibatch-mean loss:
    sample i's own loss has output gradient n * g_i."""
    n = g.shape[0]
    g = g.double() * n
    x = x.double()
    if isinstance(layer, nn.Conv2d):
        weight = torch.stack(
            [
                torch.nn.grad.conv2d_weight(
                    x[i : i + 1], layer.weight.shape, g[i : i + 1], stride=layer.stride
                )
                for i in range(n)
            ]
        )
        bias = g.sum((2, 3))
    else:
        weight = torch.einsum("bo,bi->boi", g, x)
        bias = g
    return {"weight": weight, "bias": bias}


def test_cnn_policy_relu_gradient_flow_and_fisher_per_layer_and_channel(tmp_path):
    env = make_vec_env(Pixels, n_envs=N_ENVS, seed=0)
    model = PPO(
        "CnnPolicy",
        env,
        n_steps=N_STEPS,
        batch_size=BATCH,
        n_epochs=N_EPOCHS,
        policy_kwargs=dict(features_extractor_kwargs=dict(features_dim=32)),
        device="cpu",
        seed=0,
    )
    features = model.policy.features_extractor
    cnn, linear = features.cnn, features.linear
    relus = {"cnn.1": cnn[1], "cnn.3": cnn[3], "cnn.5": cnn[5], "linear.1": linear[1]}
    layers = {"cnn.0": cnn[0], "cnn.2": cnn[2], "cnn.4": cnn[4], "linear.0": linear[0]}
    cap = Capture(relus, {**layers, "actor_head": model.policy.action_net})
    callback = ProbeCallback(
        probes=[("features", attach_relu_activation_hooks())],
        backward_probes=[
            ("features", attach_fisher_information_hooks()),
            ("features", attach_gradient_flow_hooks(beta=BETA)),
            ("features", attach_relu_gradient_flow_hooks()),
            ("actor_head", attach_fisher_information_hooks()),
        ],
        run_dir=tmp_path / "run",
        probing=ProbeSettings(
            sinks=SinksConfig(console=False),
            wandb=WandbConfig(mode="disabled"),
            strict=True,
            probe_budget=None,
        ),
    )
    model.learn(CYCLES * ROWS, callback=callback)
    cap.remove()
    records = [
        r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"
    ]
    assert len(records) == CYCLES
    assert all(len(v) == CYCLES * CALLS for v in cap.out.values())
    for c, rec in enumerate(records):
        window = slice(c * CALLS, (c + 1) * CALLS)
        # relu per layer: per channel on the three conv layers, per unit on the linear
        for name, channels in (("cnn.1", 32), ("cnn.3", 64), ("cnn.5", 64), ("linear.1", 32)):
            expected = relu_expected(cap.out[name][window])
            assert len(rec[f"probes/relu/features.{name}/active_rate"]) == channels
            for metric, value in expected.items():
                key = f"probes/relu/features.{name}/{metric}"
                assert rec[key] == pytest.approx(value, rel=REL, abs=1e-12), key
            grads = cap.grad[name][window]
            assert rec[f"probes/gradient_flow/features.{name}/rms"] == pytest.approx(
                gradient_rms_expected(grads), rel=1e-5
            )
            # gradient reaches the ReLU's input where it was active and received some
            passed = [
                per_channel(((g != 0) & (h > 0)).double())
                for h, g in zip(cap.out[name][window], grads, strict=True)
            ]
            rate = torch.cat(passed).mean(0)
            key = f"probes/relu_gradient_flow/features.{name}/"
            assert rec[key + "pass_rate"] == pytest.approx(rate.tolist(), rel=REL, abs=1e-12)
            assert rec[key + "blocked_fraction"] == pytest.approx(
                float((rate == 0).double().mean())
            )
        # the component's output is its last layer's
        assert (
            rec["probes/relu/features/active_rate"]
            == rec["probes/relu/features.linear.1/active_rate"]
        )
        # Fisher: every parameter of the encoder, the three convolutions included
        assert rec["probes/fisher/features/unsupported_params"] == 0.0
        total = 0.0
        for name, layer in layers.items():
            squares = {"weight": 0.0, "bias": 0.0}
            inputs, grads = cap.inp[name][window], cap.grad[name][window]
            n = sum(x.shape[0] for x in inputs)
            for x, g in zip(inputs, grads, strict=True):
                for p, per_sample in per_sample_grads(layer, x, g).items():
                    squares[p] += per_sample.square().sum(0)
            for p, sq in squares.items():
                trace = float(sq.sum()) / n
                key = f"probes/fisher/features/{name}.{p}.trace"
                assert rec[key] == pytest.approx(trace, rel=1e-5), key
                total += trace
        assert rec["probes/fisher/features/trace"] == pytest.approx(total, rel=1e-5)
        head_grads = cap.grad["actor_head"][window]
        unit = torch.cat([g.double() * g.shape[0] for g in head_grads]).square().mean(0)
        assert rec["probes/fisher/actor_head/unit"] == pytest.approx(unit.tolist(), rel=1e-5)
