"""The state_dict protocol and the checkpoint format.

A checkpoint of another format (older, newer or foreign) fails with one message naming
its format; ProbeSession, HookManager and a tracker resumed from their ``state_dict()`` in
the middle of an epoch report what an uninterrupted session reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from policy_probes import ProbeSettings, Run
from policy_probes.lifecycle import HookManager, HookPoint, HookRegistry, TrainingHook
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig
from trainers import TrainTool
from trainers.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    load_checkpoint,
    restore_trainer,
)

torch.set_num_threads(1)

NO_SINKS = {
    "sinks": SinksConfig(console=False, csv=False, wandb=False),
    "wandb": WandbConfig(mode="disabled"),
}


def tool(run_dir: Path) -> TrainTool:
    """A tiny CartPole run: 8-8 ReLU policy, the ReLU and Fisher probes, the ``norms``
    lifecycle hook, 3 epochs of 2 update epochs x 2 minibatches, a checkpoint a epoch."""
    cfg = TrainTool(
        run_dir=run_dir,
        seed=3,
        env={"num_envs": 2},
        policy={"hidden_sizes": [8, 8], "activation": "relu"},
        trainer={
            "total_timesteps": 3 * 2 * 16,
            "num_steps": 16,
            "num_minibatches": 2,
            "update_epochs": 2,
        },
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 1, "keep_last": 5},
        sinks={"console": False, "csv": False, "wandb": False},
        torch_threads=1,
        hooks=["norms"],
    )
    cfg.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    cfg.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    return cfg


def test_foreign_and_newer_checkpoints_fail_with_one_message(tmp_path):
    for fmt in (99, 4, 3):
        path = tmp_path / f"epoch_00000{fmt % 10}.pt"
        torch.save({"format": fmt, "epoch": 1, "policy": {}}, path)
        with pytest.raises(CheckpointError, match=rf"in format {fmt} .* reads format 5 only"):
            restore_trainer(None, load_checkpoint(path))  # type: ignore[arg-type]
    foreign = tmp_path / "weights.pt"
    torch.save({"actor.0.weight": torch.zeros(2, 2)}, foreign)
    with pytest.raises(CheckpointError, match="is not a training checkpoint"):
        load_checkpoint(foreign)


def test_a_run_writes_format5_whose_state_dicts_round_trip(tmp_path):
    run_dir = tmp_path / "run"
    tool(run_dir).invoke()
    ckpt = load_checkpoint(run_dir / "checkpoints" / "epoch_000003.pt")
    assert ckpt["format"] == CHECKPOINT_FORMAT == 5 and ckpt["mid_epoch"] is None
    assert ckpt["session"]["epoch"] == 3 and not ckpt["session"]["epoch_started"]
    assert set(ckpt["session"]["trackers"]) == {"relu", "fisher"}
    assert "norms" in ckpt["session"]["hooks"]["hooks"]


# ---------------------------------------------------------------------- session level
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class GradSum(TrainingHook):
    """Sums the gradient norm at PRE_STEP into its state; reports the sum at POST_EPOCH."""

    name = "grad_sum_test"
    hook_points = (HookPoint.PRE_STEP, HookPoint.POST_EPOCH)
    needs_prev_step_grads = True

    def compute(self, ctx):
        if ctx.point is HookPoint.PRE_STEP:
            g = torch.cat([p.grad.reshape(-1) for p in ctx.model.parameters()])
            self.state["sum"] = self.state.get("sum", torch.zeros(())) + g.norm()
            return {"seen": g.norm()}
        return {"sum": self.state.get("sum", torch.zeros(()))}


def run_session(tmp: Path, *, split_at: int | None) -> tuple[dict, torch.Tensor]:
    """Two epochs of 4 SGD steps; with ``split_at`` the session and the model are
    rebuilt from their state dicts after that many steps of the second epoch."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = torch.randn(2, 4, 16, 4)

    def session_for(model: nn.Module, optimizer, run_dir: Path) -> ProbeSession:
        s = ProbeSession(
            model,
            optimizer=optimizer,
            run=Run(run_dir),
            probing=ProbeSettings(hooks=[GradSum.name], probe_budget=None, **NO_SINKS),
        )
        s.add_training_hook("actor.1", attach_relu_activation_hooks())
        s.add_training_backward_hook("actor", attach_fisher_information_hooks())
        return s

    session = session_for(net, opt, tmp / "a")
    metrics: dict = {}
    for epoch in range(2):
        for step in range(4):
            if epoch == 1 and step == split_at:
                saved = {
                    "session": session.state_dict(),
                    "model": net.state_dict(),
                    "opt": opt.state_dict(),
                }
                saved = torch.load(_saved(tmp, saved), weights_only=True)
                session.close()
                net = Net()
                net.load_state_dict(saved["model"])
                opt = torch.optim.SGD(net.parameters(), lr=0.1)
                opt.load_state_dict(saved["opt"])
                session = session_for(net, opt, tmp / "b")
                session.load_state_dict(saved["session"])
            with session.phase("train"):
                loss = net.actor(data[epoch, step]).square().mean()
                opt.zero_grad()
                loss.backward()
                session.pre_step(loss=loss)
                opt.step()
                session.post_step()
            session.log({"train/loss": loss}, reduce="mean")
        metrics = session.epoch_end(step=(epoch + 1) * 64)
    session.close()
    return metrics, torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _saved(tmp: Path, obj: dict) -> Path:
    path = tmp / "session.pt"
    torch.save(obj, path)
    return path


@pytest.fixture
def grad_sum_hook():
    """:class:`GradSum` registered for the test (selected by name, as any hook)."""
    HookRegistry.register(GradSum)
    yield
    HookRegistry.unregister(GradSum.name)


@pytest.mark.usefixtures("grad_sum_hook")
def test_session_state_dict_resumes_mid_epoch_to_the_uninterrupted_metrics(tmp_path):
    plain, plain_params = run_session(tmp_path / "plain", split_at=None)
    resumed, resumed_params = run_session(tmp_path / "resumed", split_at=2)
    assert torch.equal(plain_params, resumed_params)
    assert resumed.keys() == plain.keys()
    assert plain["grad_sum_test/sum"] > 0 and plain["probes/relu/actor.1/samples"] == 64
    for key, value in plain.items():
        if key.startswith("probes/overhead_"):
            continue  # wall-clock measurements of the probes' cost
        assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


def test_hook_manager_state_dict_carries_gradients_and_step_records():
    net = Net()
    manager = HookManager([GradSum()], loop="external", model=net)
    net.actor(torch.randn(3, 4)).sum().backward()
    manager.fire(HookPoint.PRE_STEP, epoch=0, step=0)
    state = manager.state_dict()
    expected_prev = {n: p.grad.clone() for n, p in net.named_parameters()}
    fresh = HookManager([GradSum()], loop="external", model=net)
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert again["prev_grads"].keys() == expected_prev.keys()
    for name, grad in expected_prev.items():
        assert torch.equal(again["prev_grads"][name], grad)
    norm = torch.cat([g.reshape(-1) for g in expected_prev.values()]).norm()
    assert float(again["hooks"]["grad_sum_test"]["sum"]) == pytest.approx(float(norm))
    (record,) = fresh.flush().records
    assert (record.point, record.step) == (HookPoint.PRE_STEP, 0)
    assert record.metrics["grad_sum_test/seen"] == pytest.approx(float(norm))
