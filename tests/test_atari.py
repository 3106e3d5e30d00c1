"""The pixel path: ALE envs, the NatureCNN actor-critic, uint8 rollouts, the atari recipe."""

from __future__ import annotations

import io
import json
import math
import os
import signal
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cli
from test_no_host_sync import ForbidHostSync

from policy_probes import ComponentContext
from policy_probes.sinks import SinksConfig, WandbConfig
from trainers import (
    AtariConfig,
    CheckpointConfig,
    CNNActorCriticPolicy,
    EnvConfig,
    EvalConfig,
    PolicyConfig,
    PPOConfig,
    PPOTrainer,
    TrainerHook,
    TrainTool,
    load_checkpoint,
    make_policy,
)
from trainers.env_state import EnvStateError, capture_env_state, restore_env_state
from trainers.envs import make_vector_env
from trainers.run_control import RunStopped

ROOT = Path(__file__).resolve().parent.parent
BREAKOUT = "ALE/Breakout-v5"
FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)


def reference_nature_cnn(policy: CNNActorCriticPolicy, frames: torch.Tensor):
    """CleanRL's ppo_atari network written out with torch.nn.functional on the policy's
    weights: (logits, value)."""
    enc = policy.encoder
    x = frames.to(torch.float32) / 255.0
    for layer, stride in ((enc.conv_0, 4), (enc.conv_1, 2), (enc.conv_2, 1)):
        x = F.relu(F.conv2d(x, layer.conv.weight, layer.conv.bias, stride=stride))
    x = torch.flatten(x, 1)
    h = F.relu(F.linear(x, enc.fc.linear.weight, enc.fc.linear.bias))
    logits = F.linear(h, policy.actor_head.weight, policy.actor_head.bias)
    value = F.linear(h, policy.critic_head.weight, policy.critic_head.bias)[:, 0]
    return logits, value


def random_frames(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8)


# ---------------------------------------------------------------------- policy
def test_cnn_forward_matches_functional_nature_cnn():
    torch.manual_seed(0)
    policy = make_policy(FRAMES, gym.spaces.Discrete(6), PolicyConfig(encoder="nature_cnn"))
    assert isinstance(policy, CNNActorCriticPolicy)
    frames = random_frames(5)
    with torch.no_grad():
        ref_logits, ref_value = reference_nature_cnn(policy, frames)
        logits, value = policy(frames)
        flat_logits, flat_value = policy(frames.view(5, -1))  # as the rollout storage holds them
        float_logits, _ = policy(frames.float())  # evaluation passes float pixel values
    assert logits.shape == (5, 6) and value.shape == (5,)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(value, ref_value)
    assert torch.equal(flat_logits, logits) and torch.equal(flat_value, value)
    assert torch.equal(float_logits, logits)
    assert policy.encoder.flat_features == 64 * 7 * 7


def test_cnn_layout_and_init():
    torch.manual_seed(0)
    policy = make_policy(FRAMES, gym.spaces.Discrete(4), PolicyConfig(encoder="nature_cnn"))
    enc = policy.encoder
    shapes = [tuple(layer.conv.weight.shape) for layer in (enc.conv_0, enc.conv_1, enc.conv_2)]
    assert shapes == [(32, 4, 8, 8), (64, 32, 4, 4), (64, 64, 3, 3)]
    assert [layer.conv.stride for layer in (enc.conv_0, enc.conv_1, enc.conv_2)] == [
        (4, 4),
        (2, 2),
        (1, 1),
    ]
    assert tuple(enc.fc.linear.weight.shape) == (512, 3136)
    assert policy.resolve("encoder.*") == [
        "encoder.conv_0",
        "encoder.conv_1",
        "encoder.conv_2",
        "encoder.fc",
    ]
    # orthogonal init: rows (or columns, whichever are fewer) orthonormal times the gain
    for weight, gain in [
        (enc.conv_0.conv.weight, math.sqrt(2)),
        (enc.fc.linear.weight, math.sqrt(2)),
        (policy.actor_head.weight, 0.01),
        (policy.critic_head.weight, 1.0),
    ]:
        w = weight.detach().reshape(weight.shape[0], -1).double()
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        eye = torch.eye(gram.shape[0], dtype=torch.double)
        torch.testing.assert_close(gram, gain**2 * eye, atol=1e-5 * gain**2, rtol=0)
    assert all(
        float(p.detach().abs().max()) == 0 for n, p in policy.named_parameters() if "bias" in n
    )


def test_cnn_encoder_rejects_vector_observations():
    box = gym.spaces.Box(-1, 1, (4,), np.float32)
    with pytest.raises(ValueError, match=r"policy.encoder=nature_cnn needs uint8 image"):
        make_policy(box, gym.spaces.Discrete(2), PolicyConfig(encoder="nature_cnn"))
    float_frames = gym.spaces.Box(0, 1, (4, 84, 84), np.float32)
    with pytest.raises(ValueError, match=r"uint8 image observations of shape \(C, H, W\)"):
        make_policy(float_frames, gym.spaces.Discrete(2), PolicyConfig(encoder="nature_cnn"))
    small = gym.spaces.Box(0, 255, (4, 30, 30), np.uint8)
    with pytest.raises(ValueError, match=r"at least 36x36"):
        make_policy(small, gym.spaces.Discrete(2), PolicyConfig(encoder="nature_cnn"))
    with pytest.raises(ValueError, match=r"Set policy.encoder=nature_cnn"):
        make_policy(FRAMES, gym.spaces.Discrete(2), PolicyConfig())
    tool = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(encoder="nature_cnn"),
        trainer=PPOConfig(total_timesteps=64, num_steps=32),
    )
    with pytest.raises(ValueError, match=r"Box\(.*\(4,\), float32\).*policy.encoder=none"):
        tool.invoke()
    with pytest.raises(ValueError, match=r"encoder"):
        PolicyConfig(encoder="resnet")


# ---------------------------------------------------------------------- environments
def test_atari_env_stack_matches_gymnasium_wrappers():
    cfg = EnvConfig(id=BREAKOUT, num_envs=2, clip_reward=1.0)
    envs = make_vector_env(cfg)
    assert envs.single_observation_space == FRAMES
    # the same preprocessing composed by hand, env by env, with the same seeds
    refs = [
        gym.wrappers.FrameStackObservation(
            gym.wrappers.AtariPreprocessing(gym.make(BREAKOUT, frameskip=1), noop_max=30), 4
        )
        for _ in range(2)
    ]
    try:
        obs, _ = envs.reset(seed=7)
        ref = np.stack([env.reset(seed=7 + i)[0] for i, env in enumerate(refs)])
        assert obs.dtype == np.uint8 and np.array_equal(obs, ref)
        actions = np.random.default_rng(0).integers(0, 4, size=(20, 2))
        for a in actions:
            obs, reward, *_ = envs.step(a)
            ref = np.stack([env.step(int(a[i]))[0] for i, env in enumerate(refs)])
            assert np.array_equal(obs, ref)
        # the stacked frames are the last four frames: the newest moves to the back
        obs2, *_ = envs.step(np.zeros(2, dtype=np.int64))
        assert np.array_equal(obs2[:, :3], obs[:, 1:])
    finally:
        envs.close()
        for env in refs:
            env.close()


def test_atari_life_loss_option_and_reward_clip():
    cfg = EnvConfig(
        id=BREAKOUT,
        num_envs=1,
        clip_reward=1.0,
        atari=AtariConfig(terminal_on_life_loss=True, noop_max=0),
    )
    envs = make_vector_env(cfg)
    try:
        envs.reset(seed=3)
        envs.action_space.seed(3)
        for _ in range(2000):
            _obs, reward, terminated, _trunc, info = envs.step(envs.action_space.sample())
            assert -1.0 <= float(reward[0]) <= 1.0
            if terminated[0]:
                break
        # the episode ended with lives left (Breakout starts with 5): a life was lost
        assert terminated[0] and 0 < int(info["lives"][0]) < 5
    finally:
        envs.close()


def test_atari_env_errors():
    with pytest.raises(ValueError, match=r"env.atari.frame_skip"):
        make_vector_env(EnvConfig(id=BREAKOUT, num_envs=1, kwargs={"frameskip": 4}))
    with pytest.raises(ValueError, match=r"env.vectorization=sync or async"):
        make_vector_env(EnvConfig(id=BREAKOUT, num_envs=1, vectorization="vector_entry_point"))
    with pytest.raises(ValueError, match=r"ALE/Breakout-v5"):
        EnvConfig(id="ALE/Breakot-v5")
    with pytest.raises(ValueError, match=r"greater than or equal to 36"):
        AtariConfig(screen_size=32)


NOT_STICKY = {"repeat_action_probability": 0.0}


def test_atari_env_state_restores_the_emulator_exactly():
    cfg = EnvConfig(id=BREAKOUT, num_envs=2, clip_reward=1.0, kwargs=NOT_STICKY)
    a, b = make_vector_env(cfg), make_vector_env(cfg)
    try:
        rng = np.random.default_rng(0)
        a.reset(seed=5)
        for _ in range(30):
            a.step(rng.integers(0, 4, 2))
        buffer = io.BytesIO()
        torch.save(capture_env_state(a), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        b.reset(seed=99)
        restore_env_state(b, state)
        ends = 0
        for _ in range(400):  # several episode ends: noop resets draw from np_random
            actions = rng.integers(0, 4, 2)
            obs_a, r_a, term_a, trunc_a, _ = a.step(actions)
            obs_b, r_b, term_b, trunc_b, _ = b.step(actions)
            assert np.array_equal(obs_a, obs_b) and np.array_equal(r_a, r_b)
            assert np.array_equal(term_a, term_b) and np.array_equal(trunc_a, trunc_b)
            ends += int(term_a.sum())
        assert ends >= 2
    finally:
        a.close()
        b.close()


def test_atari_env_state_refused_clearly_with_sticky_actions():
    envs = make_vector_env(EnvConfig(id=BREAKOUT, num_envs=1))  # v5 default: 0.25
    try:
        envs.reset(seed=0)
        with pytest.raises(EnvStateError, match=r"repeat_action_probability=0.25\).*=0.0"):
            capture_env_state(envs)
    finally:
        envs.close()


class InterruptAt(TrainerHook):
    """SIGINT to this process after optimizer step ``step`` (an in-process Ctrl-C: the run
    checkpoints mid-epoch, rollout storage included, and stops)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_mb_end(self, state):
        if state.optimizer_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def small_atari_tool(run_dir: Path) -> TrainTool:
    from recipes.atari import add_probes

    tool = TrainTool(
        env=EnvConfig(id=BREAKOUT, num_envs=2, clip_reward=1.0, kwargs=NOT_STICKY),
        policy=PolicyConfig(encoder="nature_cnn"),
        trainer=PPOConfig(total_timesteps=192, num_steps=32, num_minibatches=4, update_epochs=1),
        evaluation=EvalConfig(every_epochs=0, at_end=False),
        checkpoint=CheckpointConfig(every_epochs=0, at_end=True),
        sinks=SinksConfig(console=False, jsonl=True, csv=False, wandb=False),
        wandb=WandbConfig(mode="disabled"),
        run_dir=run_dir,
        torch_threads=1,
        seed=4,
    )
    return add_probes(tool)


def test_atari_run_interrupted_mid_epoch_resumes_exactly(tmp_path: Path):
    plain = small_atari_tool(tmp_path / "plain").invoke()
    tool = small_atari_tool(tmp_path / "run")
    # epoch 2 of 3 (4 steps per epoch), after its 2nd minibatch: epoch 3's rollout then
    # runs on the restored environments
    tool.add_trainer_hook(InterruptAt(5))
    with pytest.raises(RunStopped) as info:
        tool.invoke()
    ckpt = load_checkpoint(info.value.checkpoint)
    assert ckpt["mid_epoch"] and ckpt["env"]["state"] is not None
    resumed = small_atari_tool(tmp_path / "run").invoke(resume=True)
    assert resumed.agent_step == plain.agent_step == 192
    for (name, p), (_, q) in zip(
        plain.policy.state_dict().items(), resumed.policy.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------- rollout
def test_rollout_stores_uint8_frames_and_their_values():
    torch.manual_seed(0)
    envs = make_vector_env(EnvConfig(id=BREAKOUT, num_envs=2))
    policy = make_policy(
        envs.single_observation_space, envs.single_action_space, PolicyConfig(encoder="nature_cnn")
    )
    trainer = PPOTrainer(
        envs, policy, PPOConfig(num_steps=6, num_minibatches=2, total_timesteps=12), seed=1
    )
    try:
        trainer.reset_envs()
        first = np.array(trainer.next_obs, copy=True)
        trainer.collect_rollout()
        st = trainer.storage
        assert st.obs.dtype == torch.uint8 and st.obs.shape == (6, 2, 4 * 84 * 84)
        assert np.array_equal(st.obs[0].view(2, 4, 84, 84).numpy(), first)
        with torch.no_grad():
            _, ref_value = reference_nature_cnn(policy, st.obs.view(12, 4, 84, 84))
        torch.testing.assert_close(st.values.view(12), ref_value)
        batch = next(st.minibatches(st.valid_indices, 2))
        assert batch.obs.dtype == torch.uint8
    finally:
        envs.close()


def test_recipe_probes_on_cnn_policy_run_without_host_sync():
    from recipes.atari import train

    torch.manual_seed(0)
    tool = train()
    policy = make_policy(FRAMES, gym.spaces.Discrete(4), PolicyConfig(encoder="nature_cnn"))
    ctx = ComponentContext()
    ctx.phase = "train"
    for pattern, builder, backward, placement in tool._builders:
        policy.attach(pattern, builder, ctx, backward=backward, **placement)
    frames, actions = random_frames(8, seed=1).view(8, -1), torch.randint(0, 4, (8,))
    with ForbidHostSync() as sync:
        for _ in range(2):
            logprob, entropy, value = policy.evaluate_actions(frames, actions)
            (value.square().mean() - logprob.mean() - entropy.mean()).backward()
    assert sync.calls == []
    names = set(ctx.model_metrics)
    assert {"relu", "fisher", "gradient_flow"} <= names
    policy.remove_hooks()


# ---------------------------------------------------------------------- recipe, CLI
def test_atari_recipe_runs_from_cli(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = cli(
        "run",
        "recipes.atari.train",
        "trainer.total_timesteps=256",
        "env.num_envs=2",
        "trainer.num_steps=64",
        "evaluation.at_end=false",
        "checkpoint.at_end=false",
        "torch_threads=1",
        "sinks.wandb=false",
        "probe_budget=null",  # every pass: the last epoch's keys are checked
        f"run_dir={run_dir}",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("hook_point") == "POST_EPOCH"]
    assert [r["agent_step"] for r in epochs] == [128, 256]
    last = epochs[-1]
    assert last["train/batch_size"] == 128.0
    # per layer, per channel on the conv layers: one active rate per channel or unit
    widths = {"encoder.conv_0": 32, "encoder.conv_1": 64, "encoder.conv_2": 64, "encoder.fc": 512}
    for name, width in widths.items():
        assert len(last[f"probes/relu/{name}/active_rate"]) == width
        assert 0.0 <= last[f"probes/relu/{name}/dormant_fraction"] <= 1.0
        assert last[f"probes/gradient_flow/{name}/mean"] > 0.0
    # the component's output is its fc layer's: the two keys hold the same statistics
    assert last["probes/relu/encoder/active_rate"] == last["probes/relu/encoder.fc/active_rate"]
    assert not any(k.endswith(".act/dead_fraction") for k in last)  # a block is one layer
    # every encoder parameter has an exact Fisher (the convs included), and the heads'
    assert last["probes/fisher/encoder/unsupported_params"] == 0.0
    for i in range(3):
        assert last[f"probes/fisher/encoder/conv_{i}.conv.weight.trace"] > 0.0
    parts = [k for k in last if k.startswith("probes/fisher/encoder/") and k.endswith(".trace")]
    total = sum(last[k] for k in parts)
    assert last["probes/fisher/encoder/trace"] == pytest.approx(total, rel=1e-9)
    for name in ("actor_head", "critic_head"):
        assert last[f"probes/fisher/{name}/trace"] > 0.0
        assert last[f"probes/gradient_flow/{name}/mean"] > 0.0
    # the local report shows the CNN's dead/dormant units per layer, one line per layer
    report = cli("report", str(run_dir))
    assert report.returncode == 0, report.stderr[-3000:]
    page = (run_dir / "report.html").read_text()
    assert 'id="relu-layers"' in page
    assert "per layer: encoder" in page
