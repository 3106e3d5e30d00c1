"""Distributed PPO under torchrun: 2 CPU processes (gloo) against single-process
computations over the union of both ranks' samples.

The recipe adds a trainer hook (on every rank) that keeps, with plain torch hooks, what
the relu and Fisher probes see on ``actor_mlp`` during the update phase: the component
output, its gradient, and the input and output gradient of every ``nn.Linear`` inside,
with ``context.loss_scale``. The test recomputes the probe definitions over both ranks'
tensors and compares them with rank 0's ``metrics.jsonl``.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from trainers import EnvConfig, PPOConfig, TrainerHook
from trainers.distributed import (
    DistributedRun,
    RankStatisticsHook,
    per_rank_config,
    rank_seed,
)
from trainers.envs import make_vector_env

WORLD = 2
NUM_ENVS, NUM_STEPS, EPOCHS, SEED = 2, 32, 3, 5

RECIPE = f'''
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.sinks import SinksConfig
from trainers import EnvConfig, EvalConfig, PolicyConfig, PPOConfig, TrainerHook, TrainTool
from trainers.config import CheckpointConfig

OUT = Path(__file__).parent / "capture"


class CaptureProbedTensors(TrainerHook):
    """What the relu and Fisher probes on actor_mlp record, saved per rank and epoch."""

    run_on_all_ranks = True

    def on_new_training_run(self, state):
        self.rank = dist.get_rank()
        self.handles = []
        self.fresh()
        ctx, mlp = state.context, state.policy.actor_mlp
        with torch.no_grad():  # one unit dead from the start (same change on every rank)
            mlp.layer_1.linear.bias[0] = -30.0
        OUT.mkdir(exist_ok=True)
        params = {{k: v.detach().clone() for k, v in state.policy.named_parameters()}}
        torch.save(params, OUT / f"rank{{self.rank}}_initial_params.pt")

        def recording(out):
            return ctx.phase == "train" and out.requires_grad and torch.is_grad_enabled()

        def on_output(mod, inputs, out):
            if ctx.phase != "train":
                return
            self.h.append(out.detach().clone())
            if recording(out):
                out.register_hook(lambda g: self.g.append((g.clone(), ctx.loss_scale)))

        self.handles.append(mlp.register_forward_hook(on_output))
        for name, mod in mlp.named_modules():
            if not isinstance(mod, nn.Linear):
                continue

            def on_linear(mod, inputs, out, name=name):
                if recording(out):
                    x = inputs[0].detach().clone()
                    out.register_hook(
                        lambda g: self.layers.setdefault(name, []).append(
                            (x, g.clone(), ctx.loss_scale)
                        )
                    )

            self.handles.append(mod.register_forward_hook(on_linear))

    def fresh(self):
        self.h, self.g, self.layers = [], [], {{}}

    def on_rollout_end(self, state):
        self.rollout = dict(state.rollout_stats)  # this rank's own episodes
        self.first_obs = state.trainer.storage.obs[0].clone()

    def on_epoch_end(self, state):
        torch.save(
            {{"h": self.h, "g": self.g, "layers": self.layers, "rollout": self.rollout,
              "first_obs": self.first_obs}},
            OUT / f"rank{{self.rank}}_epoch{{state.epoch}}.pt",
        )
        self.fresh()

    def on_training_end(self, state):
        for handle in self.handles:
            handle.remove()
        params = {{k: v.detach().clone() for k, v in state.policy.named_parameters()}}
        torch.save(params, OUT / f"rank{{self.rank}}_params.pt")


def train():
    cfg = TrainTool(
        name="tiny",
        env=EnvConfig(id="CartPole-v1", num_envs={NUM_ENVS}),
        policy=PolicyConfig(hidden_sizes=[8, 8], activation="relu"),
        trainer=PPOConfig(
            total_timesteps={WORLD * EPOCHS * NUM_ENVS * NUM_STEPS},
            num_steps={NUM_STEPS},
            num_minibatches=2,
            update_epochs=2,
            micro_batches=2,
        ),
        evaluation=EvalConfig(every_epochs=0, at_end=True, episodes=2, num_envs=2),
        checkpoint=CheckpointConfig(every_epochs=1, at_end=True),
        sinks=SinksConfig(console=False, wandb=False, csv=True),
        seed={SEED},
        torch_threads=1,
        probe_budget=None,  # every pass: each rank's samples are compared with its captures
    )
    cfg.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    cfg.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    cfg.add_trainer_hook(CaptureProbedTensors())
    return cfg
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process torchrun of the tiny recipe; returns its directory."""
    root = tmp_path_factory.mktemp("ddp")
    (root / "recipe.py").write_text(textwrap.dedent(RECIPE))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={WORLD}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "policy_probes.cli",
        "run",
        "recipe.py:train",
        f"run_dir={root / 'run'}",
        "--no-progress",
    ]
    # own session: on a timeout the launcher and both workers are killed together
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in 180 s (a collective out of step?):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return root


def load_capture(root: Path, rank: int, epoch: int) -> dict:
    return torch.load(root / "capture" / f"rank{rank}_epoch{epoch}.pt", weights_only=False)


def post_epoch_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["hook_point"] == "POST_EPOCH"]


def per_sample(grad: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """Per-sample gradients from the gradient of a mean loss scaled by loss_scale."""
    return grad.double() * (grad.shape[0] / loss_scale)


def union_reference(captures: list[dict]) -> dict[str, object]:
    """The relu and Fisher definitions (docs/probes) over every rank's samples."""
    h = torch.cat([hh.double() for c in captures for hh in c["h"]])
    active_rate = (h > 0).double().mean(0)
    g = torch.cat([per_sample(gg, s) for c in captures for gg, s in c["g"]])
    trace = 0.0
    for name in captures[0]["layers"]:
        parts = [p for c in captures for p in c["layers"][name]]
        x = torch.cat([xx.double() for xx, _, _ in parts])
        gl = torch.cat([per_sample(gg, s) for _, gg, s in parts])
        weight = torch.einsum("nu,ni->nui", gl, x).square().mean(0)  # per-sample outer products
        bias = gl.square().mean(0)
        trace += float(weight.sum() + bias.sum())
    return {
        "active_rate": active_rate.tolist(),
        "dead_fraction": float((active_rate == 0).double().mean()),
        "samples": h.shape[0],
        "unit": g.square().mean(0).tolist(),
        "trace": trace,
    }


def test_probe_metrics_equal_union_of_both_ranks(torchrun_run: Path) -> None:
    records = post_epoch_records(torchrun_run / "run")
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    for record in records:
        captures = [load_capture(torchrun_run, rank, record["epoch"]) for rank in range(WORLD)]
        local = [sum(hh.shape[0] for hh in c["h"]) for c in captures]
        assert all(n > 0 for n in local)
        ref = union_reference(captures)
        key = "probes/relu/actor_mlp/"
        assert record[key + "samples"] == ref["samples"] == sum(local)
        assert record[key + "active_rate"] == pytest.approx(ref["active_rate"], rel=1e-9)
        assert record[key + "dead_fraction"] == pytest.approx(ref["dead_fraction"], rel=1e-9)
        assert ref["dead_fraction"] >= 1 / 8  # the unit the recipe killed
        key = "probes/fisher/actor_mlp/"
        assert record[key + "unit"] == pytest.approx(ref["unit"], rel=1e-6)
        assert record[key + "trace"] == pytest.approx(ref["trace"], rel=1e-6)
        assert record[key + "trace"] > 0


def test_rollout_statistics_and_agent_step_cover_every_rank(torchrun_run: Path) -> None:
    steps_per_epoch = WORLD * NUM_ENVS * NUM_STEPS
    for record in post_epoch_records(torchrun_run / "run"):
        epoch = record["epoch"]
        assert record["agent_step"] == epoch * steps_per_epoch
        local = [load_capture(torchrun_run, r, epoch)["rollout"] for r in range(WORLD)]
        episodes = sum(s["episodes"] for s in local)
        assert record["rollout/episodes"] == episodes
        if episodes:
            returns = sum(s.get("episode_return", 0.0) * s["episodes"] for s in local)
            assert record["rollout/episode_return"] == pytest.approx(returns / episodes)
            assert record["rollout/episode_return_max"] == max(
                s["episode_return_max"] for s in local if s["episodes"]
            )
        assert record["rollout/valid_fraction"] == pytest.approx(
            sum(s["valid_fraction"] for s in local) / WORLD
        )


def test_each_rank_steps_its_own_seeded_environments(torchrun_run: Path) -> None:
    for rank in range(WORLD):
        first = load_capture(torchrun_run, rank, 1)["first_obs"]
        envs = make_vector_env(EnvConfig(id="CartPole-v1", num_envs=NUM_ENVS))
        expected, _ = envs.reset(seed=rank_seed(SEED, rank, NUM_ENVS))
        envs.close()
        assert torch.equal(first, torch.as_tensor(expected, dtype=first.dtype))
    assert rank_seed(SEED, 0, NUM_ENVS) == SEED  # rank 0 = the single-process run


def test_parameters_identical_across_ranks(torchrun_run: Path) -> None:
    def load(name: str) -> list[dict[str, torch.Tensor]]:
        path = torchrun_run / "capture"
        return [torch.load(path / f"rank{r}_{name}.pt", weights_only=True) for r in range(WORLD)]

    initial, final = load("initial_params"), load("params")
    assert final[0].keys() == final[1].keys() == initial[0].keys()
    for name, value in final[0].items():
        assert torch.equal(initial[0][name], initial[1][name]), name  # same start
        assert torch.equal(value, final[1][name]), name  # kept equal by DDP
    # training moved them (equality would be trivial for a frozen policy)
    assert not torch.equal(final[0]["actor_head.weight"], initial[0]["actor_head.weight"])


def test_exactly_one_set_of_outputs(torchrun_run: Path) -> None:
    run_dir = torchrun_run / "run"
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert files == [
        "checkpoints/epoch_000001.pt",
        "checkpoints/epoch_000002.pt",
        "checkpoints/epoch_000003.pt",
        "config.json",
        "metrics.csv",
        "metrics.jsonl",
    ]
    top = {p.name for p in torchrun_run.iterdir()} - {"__pycache__"}
    assert top == {"recipe.py", "capture", "run"}  # no per-rank run directories
    config = json.loads((run_dir / "config.json").read_text())
    assert config["distributed"] == {"world_size": WORLD, "backend": "gloo"}
    assert config["run_dir"] == str(run_dir)
    csv_rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + EPOCHS  # header + one row per epoch, written once
    jsonl = (run_dir / "metrics.jsonl").read_text().splitlines()
    epochs = [json.loads(line)["epoch"] for line in jsonl]
    assert sorted(epochs) == list(range(1, EPOCHS + 1))  # no record written twice


# ---------------------------------------------------------------------- in-process units
def test_single_process_is_rank_0_of_1(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with DistributedRun("cpu") as run:
        assert (run.rank, run.world_size, run.owns_group) == (0, 1, False)
        assert run.is_main and not run.distributed
        assert run.broadcast("x") == "x"
        assert run.seed(7, num_envs=4) == 7
    assert not torch.distributed.is_initialized()


def test_closing_frees_a_ddp_wrapper_left_in_a_cycle_before_the_group_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DDP wrapper in a reference cycle (as the trainer's is) holds the group through
    its reducer; close() collects it, so destroying the group really closes the gloo
    connections instead of leaving them to interpreter exit, where a rank aborted."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for var, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(var, value)
    was_enabled = gc.isenabled()
    gc.disable()  # only close() may collect the cycle
    try:
        with DistributedRun("cpu") as run:
            assert run.owns_group and torch.distributed.is_initialized()
            ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
            cycle: dict[str, object] = {"ddp": ddp}
            cycle["self"] = cycle
            wrapper = weakref.ref(ddp)
            del ddp, cycle
            assert wrapper() is not None  # kept alive by the cycle alone
        assert wrapper() is None
        assert not torch.distributed.is_initialized()
    finally:
        if was_enabled:
            gc.enable()


def test_rank_seeds_never_share_an_env_seed() -> None:
    for num_envs in (1, 8, 1500):
        seeds = [
            set(range(rank_seed(3, r, num_envs), rank_seed(3, r, num_envs) + num_envs))
            for r in range(3)
        ]
        assert not (seeds[0] & seeds[1] or seeds[1] & seeds[2] or seeds[0] & seeds[2])


def test_total_timesteps_is_the_budget_of_all_ranks() -> None:
    cfg = PPOConfig(total_timesteps=1000, num_steps=50)
    assert per_rank_config(cfg, 1, 4) is cfg
    assert per_rank_config(cfg, 2, 4).total_timesteps == 500
    with pytest.raises(
        ValueError, match="world_size \\* env.num_envs \\* trainer.num_steps = 1200"
    ):
        per_rank_config(cfg, 6, 4)


def test_rank_statistics_hook_counts_every_rank_in_agent_step() -> None:
    class Trainer:
        batch_size = 64

    class State:
        trainer = Trainer()
        agent_step = 128

    state = State()
    RankStatisticsHook(world_size=3).on_rollout_start(state)  # type: ignore[arg-type]
    assert state.agent_step == 128 + 2 * 64  # the rollout itself adds the last 64
    assert isinstance(RankStatisticsHook(3), TrainerHook)
    assert RankStatisticsHook.run_on_all_ranks  # its all-reduce is a collective
