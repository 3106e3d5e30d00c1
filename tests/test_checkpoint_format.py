"""The state_dict protocol and checkpoint formats.

Format-2 checkpoints written by the code before the protocol (commit 033a243; fixtures
and the script that wrote them in tests/fixtures/) resume to the parameters and records
that the old code's uninterrupted run produced, bit for bit; a foreign or newer file fails
with one message naming the readable formats; ProbeSession, HookManager and a tracker
resumed from their ``state_dict()`` in the middle of an epoch report what an
uninterrupted session reports.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from policy_probes.lifecycle import HookManager, HookPoint, TrainingHook
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig
from trainers.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    load_checkpoint,
    restore_trainer,
    upgrade_checkpoint,
)

torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"
NO_SINKS = {
    "sinks": SinksConfig(console=False, csv=False, wandb=False),
    "wandb": WandbConfig(mode="disabled"),
}


def fixture_tool(run_dir: Path):
    """The TrainTool of tests/fixtures/make_format2_checkpoints.py."""
    spec = importlib.util.spec_from_file_location(
        "make_format2_checkpoints", FIXTURES / "make_format2_checkpoints.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tool = module.tool(run_dir)
    tool.probe_budget = None  # every pass, as the code that wrote the fixtures observed
    return tool


def sampling_key(key: str) -> bool:
    """Keys of the probes' sampling, newer than the fixtures' records."""
    return key.startswith(("probes/overhead_", "probes/window_epochs")) or key.endswith(
        ("/passes_observed", "/rows_observed", "_se")
    )


def plasticity_key(key: str) -> bool:
    """Keys of the plasticity measures (issue 24), newer than the fixtures' records."""
    return (
        "/dormant_fraction_tau_" in key
        or key.endswith(("grad_noise_scale", "grad_sq_norm", "grad_var_trace"))
        or key.startswith("train/value_target_")
    )


def main_records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            k: v
            for k, v in r.items()
            if k != "time"
            and not k.startswith("perf/")
            and not sampling_key(k)
            and not plasticity_key(k)
        }
        for r in rows
        if r["hook_point"] == "POST_EPOCH"
    ]


# Epoch 2 of the fixture run wrote the mid-epoch checkpoint, which reduced that epoch's
# probe rows in two parts: its probe sums agree with any other run's to rounding only.
INTERRUPTED = 2
#: the fixture's probe summaries were summed by the code of its time (torch reductions);
#: today's summaries sum the same accumulators in numpy, whose summation order can differ
#: in the last bit. Within one version resume is bit-exact (tests/test_resume.py).
SUMMARY_REL = 1e-12


@pytest.mark.parametrize(("name", "first_epoch"), [("format2_epoch.pt", 2), ("format2_mid.pt", 2)])
def test_format2_checkpoint_resumes_to_the_old_codes_run(tmp_path, name, first_epoch):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    path = run_dir / "checkpoints" / name
    shutil.copy(FIXTURES / name, path)
    assert load_checkpoint(path)["format"] == 2
    result = fixture_tool(run_dir).invoke(resume=path)

    expected = torch.load(FIXTURES / "format2_final.pt", weights_only=True)["policy"]
    final = result.policy.state_dict()
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key

    old = json.loads((FIXTURES / "format2_records.json").read_text())
    new = main_records(run_dir)
    assert [r["epoch"] for r in new] == list(range(first_epoch, 4))
    for ours, theirs in zip(new, old[first_epoch - 1 :], strict=True):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if ours["epoch"] == INTERRUPTED and key.startswith("probes/"):
                assert ours[key] == pytest.approx(value, rel=1e-5), key
            elif key.startswith("probes/"):
                assert ours[key] == pytest.approx(value, rel=SUMMARY_REL, abs=0), key
            else:
                assert ours[key] == value, (ours["epoch"], key)


def test_upgraded_format2_holds_the_saved_session_state():
    old = load_checkpoint(FIXTURES / "format2_mid.pt")
    new = upgrade_checkpoint(old)
    assert new["format"] == CHECKPOINT_FORMAT == 3
    session = new["session"]
    # a mid-epoch checkpoint of epoch 2 (1-based) is inside hook epoch 1
    assert (session["epoch"], session["epoch_started"]) == (1, True)
    assert session["optimizer_step"] == old["optimizer_step"] == 7
    assert session["pending"] == old["mid_epoch"]["hook_metrics"]["metrics"]
    assert session["trackers"].keys() == old["mid_epoch"]["trackers"].keys()
    assert [r["step"] for r in session["hooks"]["records"]] == [
        r["step"] for r in old["mid_epoch"]["step_records"]
    ]
    assert session["hooks"]["hooks"].keys() == old["lifecycle"]["hooks"].keys() == {"norms"}
    assert set(new["mid_epoch"]) == {"update", "storage", "rollout_stats"}


def test_foreign_and_newer_checkpoints_fail_with_one_message(tmp_path):
    newer = tmp_path / "epoch_000001.pt"
    torch.save({"format": 99, "epoch": 1, "policy": {}}, newer)
    with pytest.raises(CheckpointError, match=r"unsupported checkpoint format 99.*\(1, 2, 3\)"):
        restore_trainer(None, load_checkpoint(newer))  # type: ignore[arg-type]
    foreign = tmp_path / "weights.pt"
    torch.save({"actor.0.weight": torch.zeros(2, 2)}, foreign)
    with pytest.raises(CheckpointError, match="is not a training checkpoint"):
        load_checkpoint(foreign)


def test_resume_writes_format3_whose_state_dicts_round_trip(tmp_path):
    run_dir = tmp_path / "run"
    fixture_tool(run_dir).invoke()
    ckpt = load_checkpoint(run_dir / "checkpoints" / "epoch_000003.pt")
    assert ckpt["format"] == 3 and ckpt["mid_epoch"] is None
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
            run_dir=run_dir,
            lifecycle_hooks=[GradSum()],
            optimizer=optimizer,
            probe_budget=None,  # every pass: the two runs observe the same rows
            **NO_SINKS,
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


def test_hook_state_of_a_checkpoint_before_one_numbering_is_renumbered():
    """Checkpoints written while the trainer's lifecycle hooks counted epochs from 0 (no
    ``hook_epochs`` in the session state) resume with the hooks' epochs in the records'
    numbering; newer ones are taken as they are."""
    from policy_probes.lifecycle import HookManager

    saved = {
        "grad_epoch": 3,
        "records": [{"point": "PRE_STEP", "epoch": 3, "step": 7, "metrics": {"a": 1.0}}],
    }
    old, new = HookManager([], loop="ppo"), HookManager([], loop="ppo")
    old.load_state_dict(saved, epoch_offset=1)
    new.load_state_dict(saved)
    assert old.state_dict()["grad_epoch"] == 4 and new.state_dict()["grad_epoch"] == 3
    assert [(r["epoch"], r["step"]) for r in old.state_dict()["records"]] == [(4, 7)]
    assert [(r["epoch"], r["step"]) for r in new.state_dict()["records"]] == [(3, 7)]
