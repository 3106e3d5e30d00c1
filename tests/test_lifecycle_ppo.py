"""Lifecycle hooks through the real PPO trainer (TrainTool -> PPOTrainer -> sinks).

Tiny CartPole runs: 4 envs x 32 steps, 3 epochs, 2 update epochs of 2 minibatches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.wrappers import vector as vw

from policy_probes import (
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.cli import main
from policy_probes.lifecycle import HookPoint, HookRegistry, TrainingHook
from trainers import PolicyConfig, PPOConfig, PPOTrainer, TrainerHook, TrainTool
from trainers.checkpoint import load_checkpoint
from trainers.policy import ActorCriticPolicy

torch.set_num_threads(1)

EPOCHS, NUM_ENVS, NUM_STEPS, UPDATE_EPOCHS, MINIBATCHES = 3, 4, 32, 2, 2


def tiny_tool(
    run_dir: Path, *, probes: bool = False, wandb: bool = False, device: str = "cpu", **kw: Any
) -> TrainTool:
    """ReLU actor (relu + relu_gradient_flow probes), tanh critic (saturation probe), Fisher
    and gradient flow on both: all five module probes can attach. ``device``: TrainTool's
    ("cpu" or "cuda")."""
    tool = TrainTool(
        run_dir=run_dir,
        device=device,
        probe_budget=None,  # every pass: exact values are compared
        seed=3,
        env={"num_envs": NUM_ENVS},
        policy={"activation": "relu", "critic_activation": "tanh", "hidden_sizes": [16, 16]},
        trainer={
            "total_timesteps": NUM_ENVS * NUM_STEPS * EPOCHS,
            "num_steps": NUM_STEPS,
            "num_minibatches": MINIBATCHES,
            "update_epochs": UPDATE_EPOCHS,
        },
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 1, "keep_last": EPOCHS, "at_end": True},
        sinks={"console": False, "csv": False, "wandb": wandb},
        wandb={"mode": "offline"},
        **kw,
    )
    if probes:
        tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        tool.add_training_backward_hook("actor_mlp", attach_relu_gradient_flow_hooks())
        tool.add_training_hook("critic_mlp", attach_saturated_activation_hooks("tanh"))
        for comp in ("actor_mlp", "critic_mlp"):
            tool.add_training_backward_hook(comp, attach_fisher_information_hooks())
            tool.add_training_backward_hook(comp, attach_gradient_flow_hooks())
    return tool


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_state(result, run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    ckpt = load_checkpoint(run_dir / "checkpoints" / f"epoch_{EPOCHS:06d}.pt")
    return {n: p.detach() for n, p in result.policy.named_parameters()}, ckpt


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pytestconfig):
    """A run with no hooks and no probes, on the test device (the ``device`` fixture's:
    the tests that compare with it run there)."""
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    result = tiny_tool(run_dir, device=pytestconfig.test_device.type).invoke()
    return result, run_dir


def assert_same_trajectory(baseline, result, run_dir: Path) -> None:
    base_result, base_dir = baseline
    params, ckpt = final_state(result, run_dir)
    base_params, base_ckpt = final_state(base_result, base_dir)
    assert params.keys() == base_params.keys()
    for name in params:
        assert torch.equal(params[name], base_params[name]), name
    # Adam moments and step counts, the LR schedule and every RNG as well
    for idx, st in base_ckpt["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(ckpt["optimizer"]["state"][idx][key], value), (idx, key)
    assert ckpt["scheduler"] == base_ckpt["scheduler"]
    assert torch.equal(ckpt["rng"]["torch"], base_ckpt["rng"]["torch"])
    if next(iter(params.values())).is_cuda:  # the CUDA generators, which hooks draw from
        assert len(ckpt["rng"]["cuda"]) == len(base_ckpt["rng"]["cuda"]) > 0
        for ours, base in zip(ckpt["rng"]["cuda"], base_ckpt["rng"]["cuda"], strict=True):
            assert torch.equal(ours, base)
    assert torch.equal(ckpt["trainer_rng"]["sample"], base_ckpt["trainer_rng"]["sample"])
    assert torch.equal(ckpt["trainer_rng"]["shuffle"], base_ckpt["trainer_rng"]["shuffle"])
    # and the per-epoch training statistics the loop reported
    base = [r for r in records(base_dir) if r["hook_point"] == "POST_EPOCH"]
    ours = [r for r in records(run_dir) if r["hook_point"] == "POST_EPOCH"]
    for b, o in zip(base, ours, strict=True):
        for key in ("train/policy_loss", "train/value_loss", "train/approx_kl", "train/grad_norm"):
            assert o[key] == b[key], key


def test_every_observer_and_probe_leaves_the_trajectory_bit_identical(baseline, tmp_path, device):
    run_dir = tmp_path / "run"
    result = tiny_tool(
        run_dir, probes=True, with_hooks="observers", snapshot_every=1, device=device.type
    ).invoke()
    assert result.hook_errors == {}
    assert_same_trajectory(baseline, result, run_dir)
    last = result.metrics
    for key in (
        "norms/weight_norm",
        "feature_rank/actor_mlp/effective_rank",
        "adam_dynamics/step_rms",
        "probes/relu/actor_mlp/dead_fraction",
        "probes/saturation_tanh/critic_mlp/saturated_fraction",
        "probes/fisher/actor_mlp/trace",
        "probes/gradient_flow/critic_mlp/rms",
        "probes/relu_gradient_flow/actor_mlp/pass_rate",
    ):
        assert any(k.startswith(key) for k in last), key


def test_every_intervention_including_the_corrupting_debug_hook_is_undone(
    baseline, tmp_path, device
):
    run_dir = tmp_path / "run"
    tool = tiny_tool(
        run_dir, probes=True, with_hooks="with_debug", snapshot_every=1, device=device.type
    )
    tool.hook_config = {"hessian.iters": 5, "hessian.trace_samples": 2, "counterfactual.replays": 1}
    result = tool.invoke()
    assert_same_trajectory(baseline, result, run_dir)
    main_records = [r for r in records(run_dir) if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in main_records] == [1, 2, 3]
    for r in main_records:
        # the interventions ran (and so did the debug hook, which raised every time)
        assert math.isfinite(r["hessian/top_eigenvalue"])
        assert r["policy_fisher/trace"] > 0
        assert r["counterfactual/update_norm"] > 0
        assert r["debug_corrupt/error"] == 1.0
    assert set(result.hook_errors) == {"lifecycle.debug_corrupt"}


class Capture(TrainerHook):
    """Copies what the tests recompute independently (runs after the epoch's records)."""

    def __init__(self) -> None:
        self.init: dict[str, torch.Tensor] = {}
        self.params: list[dict[str, torch.Tensor]] = []
        self.features: list[torch.Tensor] = []
        self.epochs: list[dict[str, Any]] = []

    def on_new_training_run(self, state) -> None:
        self.init = {n: p.detach().clone() for n, p in state.policy.named_parameters()}

    @torch.no_grad()
    def on_rollout_end(self, state) -> None:
        st = state.trainer.storage
        obs = st.obs.view(st.num_steps * st.num_envs, -1)[st.valid_indices]
        self.features.append(state.policy.actor_mlp(obs).double())

    def on_epoch_end(self, state) -> None:
        self.params.append({n: p.detach().clone() for n, p in state.policy.named_parameters()})
        self.epochs.append(
            {
                "loss_stats": dict(state.loss_stats),
                "rollout_stats": dict(state.rollout_stats),
                "optimizer_step": state.optimizer_step,
                "post_epoch": dict(state.trainer.session.hooks.last_metrics[HookPoint.POST_EPOCH]),
            }
        )


def norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in tensors])))


def test_hook_metrics_reach_jsonl_and_wandb_with_the_right_values(tmp_path, device):
    from wandb_reader import history_rows, run_file, wandb_records

    run_dir = tmp_path / "run"
    tool = tiny_tool(run_dir, probes=True, wandb=True, snapshot_every=2, device=device.type)
    tool.hooks = ["norms", "feature_rank", "adam_dynamics"]
    cap = Capture()
    result = tool.add_trainer_hook(cap).invoke()
    assert result.sink_failures == {} and result.hook_errors == {}

    rows = records(run_dir)
    assert [(r["epoch"], r["hook_point"]) for r in rows] == [
        (1, "PRE_STEP"),
        (1, "POST_EPOCH"),
        (2, "PRE_STEP"),
        (2, "POST_EPOCH"),
        (2, "SNAPSHOT"),
        (3, "PRE_STEP"),
        (3, "POST_EPOCH"),
    ]
    main_rows = [r for r in rows if r["hook_point"] == "POST_EPOCH"]
    step_rows = [r for r in rows if r["hook_point"] == "PRE_STEP"]
    layers = {
        "actor_head": ("actor_head.weight", "actor_head.bias"),
        "critic_mlp.layer_1.linear": (
            "critic_mlp.layer_1.linear.weight",
            "critic_mlp.layer_1.linear.bias",
        ),
    }
    prev = cap.init
    for e, (r, step_row, params, seen) in enumerate(
        zip(main_rows, step_rows, cap.params, cap.epochs, strict=True)
    ):
        # norms, recomputed from the parameters after the epoch's update
        assert r["norms/weight_norm"] == pytest.approx(norm(params.values()), rel=1e-5)
        for layer, names in layers.items():
            assert r[f"norms/weight_norm/{layer}"] == pytest.approx(
                norm(params[n] for n in names), rel=1e-5
            )
        assert r["norms/dist_from_init"] == pytest.approx(
            norm(params[n] - cap.init[n] for n in params), rel=1e-4
        )
        assert r["norms/update_ratio"] == pytest.approx(
            norm(params[n] - prev[n] for n in params) / norm(prev.values()), rel=1e-4
        )
        prev = params
        # pre-clip gradient norm: mean over the epoch's steps, = the trainer's own mean
        assert step_row["norms/grad_norm"] == r["norms/grad_norm"]
        assert r["norms/grad_norm"] == pytest.approx(r["train/grad_norm"], rel=1e-5)
        # feature_rank on this epoch's rollout observations (numpy SVD)
        s = np.linalg.svd(cap.features[e].cpu().numpy(), compute_uv=False)
        p = s / s.sum()
        assert r["feature_rank/actor_mlp/effective_rank"] == pytest.approx(
            math.exp(-(p[p > 0] * np.log(p[p > 0])).sum()), rel=1e-6
        )
        assert r["feature_rank/actor_mlp/stable_rank"] == pytest.approx(
            (s**2).sum() / s[0] ** 2, rel=1e-6
        )
        # adam_dynamics: Adam's step count = optimizer steps so far
        assert r["adam_dynamics/optimizer_step"] == seen["optimizer_step"]
        assert seen["optimizer_step"] == (e + 1) * UPDATE_EPOCHS * MINIBATCHES
        # training_metrics returned exactly the trainer's own statistics
        hook = seen["post_epoch"]
        assert {k: hook[k] for k in hook if k.startswith("train/")} == {
            f"train/{k}": v for k, v in seen["loss_stats"].items()
        }
        assert hook["rollout/episode_return"] == seen["rollout_stats"]["episode_return"]
        assert hook["perf/sps"] == seen["rollout_stats"]["sps"]
        # the probes' report: the probe window is the epoch's update phase
        batch = seen["loss_stats"]["batch_size"]
        assert r["probes/relu/actor_mlp/samples"] == UPDATE_EPOCHS * batch
    # the final weight norm matches the checkpoint written at the last epoch
    _, ckpt = final_state(result, run_dir)
    assert main_rows[-1]["norms/weight_norm"] == pytest.approx(
        norm(v for k, v in ckpt["policy"].items() if k in cap.init), rel=1e-5
    )

    # W&B (offline run file): the same hook values, keyed by agent_step
    wb = [
        row for row in history_rows(wandb_records(run_file(run_dir))) if "norms/weight_norm" in row
    ]
    assert [row["agent_step"] for row in wb] == [r["agent_step"] for r in main_rows]
    assert [row["norms/weight_norm"] for row in wb] == pytest.approx(
        [r["norms/weight_norm"] for r in main_rows]
    )


class Boom(TrainingHook):
    name = "boom_test"
    hook_points = (HookPoint.PRE_STEP, HookPoint.POST_EPOCH)

    def compute(self, ctx):
        if ctx.point is HookPoint.POST_EPOCH and ctx.epoch == 1:
            raise RuntimeError("boom at epoch 1")
        return {"ok": torch.ones(())}


@pytest.fixture
def boom():
    HookRegistry.register(Boom)
    yield Boom
    HookRegistry.unregister(Boom.name)


def test_a_raising_hook_is_reported_and_training_goes_on(boom, baseline, tmp_path, caplog, device):
    run_dir = tmp_path / "run"
    result = tiny_tool(run_dir, hooks=["boom_test"], device=device.type).invoke()
    assert result.epochs == EPOCHS
    assert result.hook_errors == {"lifecycle.boom_test": "RuntimeError: boom at epoch 1"}
    assert "boom at epoch 1" in caplog.text
    main_rows = [r for r in records(run_dir) if r["hook_point"] == "POST_EPOCH"]
    # the hook's epoch 1 is the record's epoch 1 (one numbering): the first record
    assert [r["epoch"] for r in main_rows] == [1, 2, 3]
    assert [r.get("boom_test/error") for r in main_rows] == [1.0, None, None]
    assert [r.get("boom_test/ok") for r in main_rows] == [1.0, 1.0, 1.0]  # PRE_STEP means
    assert_same_trajectory(baseline, result, run_dir)


def test_demand_driven_nothing_prepared_without_hooks(tmp_path, device):
    class Inspect(TrainerHook):
        def on_training_end(self, state):
            t = state.trainer
            self.seen = (
                [h.name for h in t.session.hooks.hooks],
                t._fire_steps,
                t.session.wants_observations,
                t._model_data_context,
                t.session.hooks.needs_pre_epoch_state,
            )

    empty, observers, counterfactual = Inspect(), Inspect(), Inspect()
    tiny_tool(tmp_path / "a", device=device.type).add_trainer_hook(empty).invoke()
    assert empty.seen == ([], False, False, None, False)
    tiny_tool(tmp_path / "b", with_hooks="observers", device=device.type).add_trainer_hook(
        observers
    ).invoke()
    names, steps, rollout, mctx, pre_epoch = observers.seen
    assert steps and rollout and "norms" in names
    assert mctx is None and not pre_epoch  # no intervention: no ModelDataContext built
    tool = tiny_tool(tmp_path / "c", hooks=["counterfactual"], device=device.type)
    tool.hook_config = {"counterfactual.replays": 1}
    tool.add_trainer_hook(counterfactual).invoke()
    names, steps, rollout, mctx, pre_epoch = counterfactual.seen
    assert names == ["training_metrics", "counterfactual"]
    assert not steps and not rollout and mctx is not None and pre_epoch


def make_trainer(micro_batches: int = 1, device: torch.device | str = "cpu") -> PPOTrainer:
    """A trainer that has collected one rollout; its policy built on the CPU from seed 0,
    then moved to ``device``, where the trainer runs."""
    envs = vw.RecordEpisodeStatistics(
        gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    )
    cfg = PPOConfig(
        total_timesteps=128, num_steps=64, num_minibatches=2, micro_batches=micro_batches
    )
    torch.manual_seed(0)
    policy = ActorCriticPolicy(
        envs.single_observation_space, envs.single_action_space, PolicyConfig(hidden_sizes=[8])
    ).to(device)
    trainer = PPOTrainer(envs, policy, cfg, seed=0, device=device)
    trainer.reset_envs()
    trainer.collect_rollout()
    return trainer


def test_ppo_model_context_replays_the_trainers_own_update(device):
    trainer = make_trainer(micro_batches=2, device=device)
    mctx = trainer.model_data_context()
    params = list(trainer.policy.parameters())
    order = trainer.storage.shuffled_order(torch.Generator().manual_seed(5))
    token = mctx.save_checkpoint()
    mean_grads = mctx.run_training_epoch(order)
    replayed = [p.detach().clone() for p in params]
    mctx.restore_checkpoint(token)

    # the loop's update epoch with the same order, by hand
    grads = []
    for batch in trainer.storage.minibatches(order, trainer.cfg.num_minibatches):
        trainer.accumulate_gradients(batch)
        grads.append([p.grad.clone() for p in params])
        trainer.clip_and_step()
    for a, b in zip(replayed, params, strict=True):
        assert torch.equal(a, b)
    sizes = [len(b) for b in trainer.storage.minibatches(order, trainer.cfg.num_minibatches)]
    for i, (name, g) in enumerate(mean_grads.items()):
        expected = sum(gs[i] * n for gs, n in zip(grads, sizes, strict=True)) / sum(sizes)
        torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-7, msg=name)
    # one-pass loss gradient == the micro-batched one
    batch = next(mctx.minibatches())
    trainer.accumulate_gradients(batch)
    micro = [p.grad.clone() for p in params]
    for g, m in zip(mctx.compute_batch_gradients(batch).values(), micro, strict=True):
        torch.testing.assert_close(g, m, rtol=1e-5, atol=1e-6)
    assert mctx.num_samples() == trainer.storage.size
    assert mctx.observations().shape == (trainer.storage.size, trainer.policy.obs_dim)
    trainer.envs.close()


def test_ppo_model_context_needs_a_rollout_first(device):
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    policy = ActorCriticPolicy(envs.single_observation_space, envs.single_action_space)
    trainer = PPOTrainer(
        envs, policy.to(device), PPOConfig(total_timesteps=128, num_steps=64), device=device
    )
    with pytest.raises(RuntimeError, match="no rollout yet"):
        trainer.model_data_context().compute_gradients()
    envs.close()


RECIPE = (
    "from trainers import TrainTool\n"
    "def train() -> TrainTool:\n"
    "    return TrainTool(policy={'hidden_sizes': [8]}, torch_threads=1, hooks=['adam_dynamics'])\n"
)
FAST = [
    "trainer.total_timesteps=256",
    "trainer.num_steps=32",
    "wandb.mode=disabled",
    "sinks.console=false",
    "sinks.csv=false",
    "evaluation.every_epochs=0",
    "evaluation.at_end=false",
    "--no-progress",
]


def test_cli_hook_flags_reach_the_run(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "out"
    argv = ["run", f"{recipe}:train", *FAST, f"run_dir={run_dir}"]
    flags = [
        "--hooks",
        "norms",
        "--with-hooks",
        "minimal",
        "--hook-config",
        "norms.per_layer=false",
    ]
    assert main([*argv, *flags]) == 0
    saved = json.loads((run_dir / "config.json").read_text())["train_tool"]
    assert saved["hooks"] == ["adam_dynamics", "norms"]  # --hooks extends the recipe's
    assert saved["with_hooks"] == "minimal"
    assert saved["hook_config"] == {"norms.per_layer": False}
    last = [r for r in records(run_dir) if r["hook_point"] == "POST_EPOCH"][-1]
    assert "norms/weight_norm" in last and "adam_dynamics/step_rms" in last
    assert not any(k.startswith("norms/weight_norm/") for k in last)  # per_layer=false


def test_cli_bad_hook_flags_exit_2(tmp_path, capsys):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE)
    base = ["run", f"{recipe}:train", "--dry-run"]
    assert main([*base, "--hooks", "nrms"]) == 2
    assert "Did you mean 'norms'" in capsys.readouterr().err
    assert main([*base, "--hooks", "hessian", "--hook-config", "hessian.iterz=3"]) == 2
    assert "no parameter 'iterz'" in capsys.readouterr().err
    assert main([*base, "--with-hooks", "everything"]) == 2
    assert "unknown hook group 'everything'" in capsys.readouterr().err
    assert main([*base, "hooks=norms,hesian"]) == 2
    assert "unknown hook 'hesian'" in capsys.readouterr().err


def test_hooks_list_and_describe(capsys):
    assert main(["hooks", "list"]) == 0
    out = capsys.readouterr().out
    for name in HookRegistry.names():
        assert name in out
    assert main(["hooks", "describe", "hessian"]) == 0
    out = capsys.readouterr().out
    for key in HookRegistry.get("hessian").metrics:
        assert f"hessian/{key}" in out
    assert "SNAPSHOT" in out and "expensive" in out and "rank 0 only" in out
    assert main(["hooks", "describe", "hesian"]) == 2
    assert "Did you mean 'hessian'" in capsys.readouterr().err
