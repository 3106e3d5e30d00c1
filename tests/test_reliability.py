"""Reliability (issue 8): faults a run survives, bad input that gets a clear error, and the
safety rules, each proven here or in the test named in ``docs/reliability.md``.

Every run is real (CartPole, a few hundred environment steps); nothing is mocked.
Sections: probe faults, non-finite values, bad input, safety.
"""

from __future__ import annotations

import ast
import csv
import ctypes
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from policy_probes import Observation, Probe
from policy_probes.cli import main
from policy_probes.context import ComponentContext
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import attach_gradient_flow_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.records import NONFINITE_KEY, read_jsonl
from trainers import TrainerHook, TrainTool
from trainers.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
NUM_ENVS, NUM_STEPS, NUM_MINIBATCHES, UPDATE_EPOCHS = 2, 16, 2, 2


def tiny_tool(run_dir: Path, epochs: int = 3, **kw: Any) -> TrainTool:
    """A CartPole run of ``epochs`` x 32 steps; JSONL only unless ``sinks`` says otherwise."""
    kw.setdefault("sinks", {"console": False, "csv": False, "wandb": False})
    kw.setdefault("checkpoint", {"every_epochs": 0, "at_end": False})
    kw.setdefault("snapshot_every", 0)
    kw.setdefault("probe_budget", None)  # every pass: exact values are compared
    return TrainTool(
        run_dir=run_dir,
        seed=3,
        torch_threads=1,
        env={"num_envs": NUM_ENVS},
        policy={"activation": "relu", "hidden_sizes": [16, 16]},
        trainer={
            "total_timesteps": NUM_ENVS * NUM_STEPS * epochs,
            "num_steps": NUM_STEPS,
            "num_minibatches": NUM_MINIBATCHES,
            "update_epochs": UPDATE_EPOCHS,
        },
        evaluation={"every_epochs": 0, "at_end": False},
        **kw,
    )


def epoch_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]


def assert_finite_probe_metrics(metrics: dict[str, Any]) -> None:
    """Every ``probes/*`` value is a finite float or a list of finite floats."""
    probe_keys = [k for k in metrics if k.startswith("probes/")]
    assert probe_keys
    for key in probe_keys:
        values = metrics[key] if isinstance(metrics[key], list) else [metrics[key]]
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), key


# =========================================================================== probe faults
FAULT_EPOCH = 2


class FlakyProbe(Probe):
    """A custom forward probe that raises from epoch ``FAULT_EPOCH`` on, as a probe does
    when its component starts returning something it does not expect."""

    name = "flaky"

    def __init__(self, clock: dict[str, int]) -> None:
        super().__init__()
        self.clock = clock
        self.records = 0
        self.observations: list[Observation] = []

    def __call__(self, component: str, context: ComponentContext, placement: Any = None) -> Any:
        obs = super().__call__(component, context, placement)
        self.observations.append(obs)
        return obs

    def record(self, obs, module: nn.Module, output: torch.Tensor, weight) -> None:
        self.records += 1
        if self.clock["epoch"] >= FAULT_EPOCH:
            raise TypeError(f"unexpected output type in epoch {self.clock['epoch']}")


class Clock(TrainerHook):
    """Tells the flaky probe the epoch; remembers the probe's call count at each epoch end."""

    def __init__(self) -> None:
        self.clock = {"epoch": 0}
        self.probes: list[FlakyProbe] = []
        self.calls: list[int] = []

    def on_rollout_start(self, state) -> None:
        self.clock["epoch"] = state.epoch

    def on_epoch_end(self, state) -> None:
        self.calls.append(sum(o.calls for p in self.probes for o in p.observations))

    def builder(self) -> FlakyProbe:
        probe = FlakyProbe(self.clock)
        self.probes.append(probe)
        return probe


def flaky_tool(run_dir: Path, clock: Clock, **kw: Any) -> TrainTool:
    tool = tiny_tool(run_dir, **kw)
    tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
    tool.add_training_hook("actor_mlp", clock.builder())
    return tool.add_trainer_hook(clock)


def test_a_raising_probe_is_disabled_reported_once_recorded_and_training_goes_on(tmp_path, caplog):
    baseline = tiny_tool(tmp_path / "base").add_training_hook(
        "actor_mlp", attach_relu_activation_hooks()
    )
    baseline.invoke()
    clock = Clock()
    caplog.set_level(logging.ERROR, logger="policy_probes")
    result = flaky_tool(tmp_path / "run", clock).invoke()

    assert result.epochs == 3  # training went on
    # reported once, naming probe and component, with the exception
    reports = [r for r in caplog.records if "flaky" in r.getMessage()]
    assert len(reports) == 1
    message = reports[0].getMessage()
    assert "'flaky'" in message and "'actor_mlp'" in message
    assert "TypeError: unexpected output type in epoch 2" in message
    # disabled: called in epoch 1 and once in epoch 2 (the call that raised), never after
    (probe,) = clock.probes
    (obs,) = probe.observations
    assert not obs.enabled
    assert clock.calls[0] == probe.records - 1 > 0  # epoch 1: every train-phase forward
    assert clock.calls[1:] == [clock.calls[0] + 1] * 2
    # recorded as a metric in the epoch of the fault and every later one
    key = "probes/errors/flaky/actor_mlp"
    records = epoch_records(tmp_path / "run")
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r.get(key) for r in records] == [None, 1.0, 1.0]
    # the other probe and the trajectory are untouched: same values as without the fault
    base = epoch_records(tmp_path / "base")
    for ours, theirs in zip(records, base, strict=True):
        # the flaky probe's error flag, its part of the measured overhead and the passes
        # and rows it observed
        flaky = {f"probes/flaky/actor_mlp/{k}" for k in ("passes_observed", "rows_observed")}
        assert set(ours) - set(theirs) <= {key, "probes/overhead_seconds/passes.flaky", *flaky}
        for name, value in theirs.items():
            # wall-clock measurements differ between runs (the probes' overhead too)
            if name != "time" and not name.startswith(("perf/", "probes/overhead_")):
                assert ours[name] == value, (ours["epoch"], name)


def test_strict_makes_a_raising_probe_fatal(tmp_path):
    clock = Clock()
    tool = flaky_tool(tmp_path / "run", clock, strict=True)
    with pytest.raises(TypeError, match="unexpected output type in epoch 2"):
        tool.invoke()
    # epoch 1 was emitted; epoch 2 died in its update phase; the hooks are gone
    assert [r["epoch"] for r in epoch_records(tmp_path / "run")] == [1]
    assert clock.probes[0].observations[0].enabled


# ========================================================================= non-finite values
class PoisonWeight(TrainerHook):
    """Sets one weight of the actor to NaN after the first minibatch of the last epoch.

    From the next minibatch on the loss is NaN (one NaN weight feeds every sample), so
    the first non-finite loss is update epoch 0, minibatch 1 of that epoch."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.step_after = -1
        self.samples: list[int] = []

    def on_rollout_end(self, state) -> None:
        self.samples.append(state.trainer.storage.size)  # valid transitions of the rollout

    def on_mb_end(self, state) -> None:
        if state.epoch == self.epoch and state.update_epoch == 0 and state.mb_idx == 0:
            with torch.no_grad():
                state.policy.actor_mlp.layer_0.linear.weight[0, 0] = float("nan")
            self.step_after = state.optimizer_step  # the index of the next optimizer step


def test_nan_loss_is_reported_with_epoch_and_step_and_probe_metrics_stay_finite(tmp_path, caplog):
    poison = PoisonWeight(epoch=2)
    tool = tiny_tool(tmp_path / "run", epochs=2)
    tool.add_training_hook("actor_mlp.layer_1", attach_relu_activation_hooks())
    tool.add_training_backward_hook("actor_mlp.layer_1", attach_gradient_flow_hooks())
    tool.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
    tool.add_trainer_hook(poison)
    caplog.set_level(logging.WARNING, logger="trainers")
    result = tool.invoke()

    steps_per_epoch = UPDATE_EPOCHS * NUM_MINIBATCHES
    assert poison.step_after == steps_per_epoch + 1  # epoch 1 took steps 0..3
    warnings = [r.getMessage() for r in caplog.records if "non-finite loss" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        f"non-finite loss at epoch 2, update epoch 0, minibatch 1 (step {poison.step_after})"
    )
    assert f"{steps_per_epoch - 1} of this epoch's {steps_per_epoch}" in warnings[0]
    records = epoch_records(tmp_path / "run")
    assert [r["train/nonfinite_loss_steps"] for r in records] == [0.0, steps_per_epoch - 1]
    assert math.isnan(result.metrics["train/policy_loss"])  # the loss itself is not hidden

    # probe metrics: never NaN; the non-finite values are counted instead
    assert_finite_probe_metrics(result.metrics)
    for r in records:
        assert not any(k.startswith("probes/") for k in r.get(NONFINITE_KEY, []))
    first, last = records
    relu = "probes/relu/actor_mlp.layer_1/nonfinite_fraction"
    grad = "probes/gradient_flow/actor_mlp.layer_1/nonfinite_fraction"
    fisher = "probes/fisher/actor_mlp/nonfinite_fraction"
    assert first[relu] == first[grad] == first[fisher] == 0.0
    # layer_1 is NaN for every sample from minibatch 1 of update epoch 0 on: all rows of
    # update epoch 1 and the second minibatch (torch.tensor_split: floor(n/2) rows) of 0
    n = poison.samples[-1]
    assert last[relu] == pytest.approx((n // 2 + n) / (2 * n), rel=1e-12)
    assert last[grad] > 0.0 and last[fisher] > 0.0


# ============================================================================== bad input
def test_glob_that_matches_nothing_fails_before_training_and_lists_the_names(tmp_path):
    tool = tiny_tool(tmp_path / "run").add_training_hook(
        "actor_mlp.layer_9*", attach_relu_activation_hooks()
    )
    with pytest.raises(KeyError, match="unknown glob pattern 'actor_mlp.layer_9\\*'") as exc:
        tool.invoke()
    for name in ("actor_mlp.layer_0", "actor_mlp.layer_1.act", "critic_head"):
        assert name in str(exc.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_builder_mistakes_through_train_tool(tmp_path):
    tool = tiny_tool(tmp_path / "run")
    with pytest.raises(TypeError, match="must be callable"):
        tool.add_training_hook("actor_mlp", "relu")
    # the builder function itself instead of the builder it makes: caught when added
    with pytest.raises(TypeError, match=r"did you forget the parentheses.*attach_relu_act"):
        tool.add_training_hook("actor_mlp", attach_relu_activation_hooks)
    # a builder whose result is not a hook
    tool = tiny_tool(tmp_path / "run2").add_training_hook("critic_mlp", lambda name, ctx: 42)
    with pytest.raises(TypeError, match="returned an object of type int for component"):
        tool.invoke()
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


CLI_FAST = ["trainer.total_timesteps=512", "wandb.mode=disabled", "--dry-run"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("policy.activation=rleu", "choose one of ['elu', 'gelu', 'identity', 'leaky_relu'"),
        ("trainer.num_steps=abc", "trainer.num_steps: Input should be a valid integer"),
        ("trainer.learning_rate=fast", "trainer.learning_rate: Input should be a valid number"),
        ("policy.hidden_sizes=wide", "policy.hidden_sizes: Input should be a valid list"),
        ("trainer.num_steps=0", "trainer.num_steps: Input should be greater than 0"),
        ("env.num_envs=0", "env.num_envs: Input should be greater than 0"),
        ("trainer.num_minibatches=0", "trainer.num_minibatches: Input should be greater than 0"),
        ("env.id=CartPol-v1", "unknown gymnasium environment id 'CartPol-v1'. Did you mean"),
    ],
)
def test_cli_bad_values_exit_2_naming_the_key(override, expected, capsys):
    assert main(["run", "recipes.cartpole.train", *CLI_FAST, override]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err
    assert captured.out == ""  # nothing resolved, nothing run


def test_cli_recipe_targets_that_do_not_resolve_exit_2(tmp_path, capsys):
    missing = tmp_path / "nowhere.py"
    assert main(["run", f"{missing}:train", *CLI_FAST]) == 2
    assert f"recipe file '{missing}' does not exist" in capsys.readouterr().err
    assert main(["run", "recipes.cartpole.trian", *CLI_FAST]) == 2
    assert "has no function 'trian'. Did you mean train?" in capsys.readouterr().err
    returns_none = tmp_path / "none_recipe.py"
    returns_none.write_text("def train():\n    return None\n")
    assert main(["run", f"{returns_none}:train", *CLI_FAST]) == 2
    assert "a recipe must return a TrainTool" in capsys.readouterr().err


# A directory that turns read-only mid-run. Permission bits do not bind a process with
# CAP_DAC_OVERRIDE (root), so the writer runs in a child process that, when the tests run
# as root, drops that capability (and CAP_DAC_READ_SEARCH) from its bounding set before
# exec: then root is held to the permission bits like any user.
READ_ONLY_RUN = """
import json, os, sys
from pathlib import Path
from policy_probes.records import Record
from policy_probes.sinks import CSVSink, JSONLSink, SinkGroup
run = Path(sys.argv[1])
run.mkdir()
group = SinkGroup([JSONLSink(run), CSVSink(run)])
for epoch in range(4):
    metrics = {"train/policy_loss": 0.5 * epoch}
    if epoch >= 2:
        os.chmod(run, 0o555)  # read-only from now on
        metrics["probes/errors/relu/actor_mlp"] = 1.0  # a new CSV column: header rewrite
    group.emit(Record.of(metrics, epoch, "POST_EPOCH"))
group.close()
print(json.dumps(group.failures))
"""


def _drop_dac_override() -> None:
    """In the child before exec: remove CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2)
    from the capability bounding set (prctl PR_CAPBSET_DROP = 24)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_a_directory_turning_read_only_stops_the_csv_and_the_jsonl_keeps_every_epoch():
    base = Path(tempfile.mkdtemp(prefix="pp-read-only-"))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", READ_ONLY_RUN, str(base / "run")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            preexec_fn=_drop_dac_override if os.geteuid() == 0 else None,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        failures = json.loads(proc.stdout)
        assert list(failures) == ["csv"]
        assert "Permission denied" in failures["csv"]
        run = base / "run"
        jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in jsonl] == [0, 1, 2, 3]
        assert [r["train/policy_loss"] for r in jsonl] == [0.0, 0.5, 1.0, 1.5]
        with open(run / "metrics.csv", newline="") as f:  # whole, with the epochs before
            assert [int(r["epoch"]) for r in csv.DictReader(f)] == [0, 1]
    finally:
        if (base / "run").exists():
            os.chmod(base / "run", 0o755)
        shutil.rmtree(base)


# ================================================================================= safety
SECRET = "local-" + "5f3c9a1e7b2d4680" * 3


def test_wandb_api_key_never_reaches_logs_outputs_or_wandb_files(tmp_path, monkeypatch, capfd):
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "settings").write_text(f"[default]\napi_key = {SECRET}\n")
    (home / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SECRET}\n")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("NETRC", str(home / "netrc"))
    for var, sub in (
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        monkeypatch.setenv(var, str(home / sub))
    logs: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append(self.format(record))

    handler = Collect(level=logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        tool = tiny_tool(
            tmp_path / "run",
            epochs=2,
            sinks={"console": True, "csv": True, "wandb": True},
            wandb={"mode": "offline"},
            snapshot_every=1,  # the console sink prints its table
        )
        tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        result = tool.invoke()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert result.sink_failures == {}
    out = capfd.readouterr()
    assert logs and "snapshot, epoch 2" in out.err  # the run logged and printed its table
    for text in (*logs, out.out, out.err):
        assert SECRET not in text
    run_files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    names = {p.name for p in run_files}
    assert {"config.json", "metrics.jsonl", "metrics.csv"} <= names
    assert any(p.suffix == ".wandb" for p in run_files)
    for path in run_files + [p for p in home.rglob("*") if p.is_file()]:
        if path in (home / "netrc", home / "config" / "settings"):
            continue  # the files holding the key on purpose
        assert SECRET.encode() not in path.read_bytes(), path


def _payload(path: str) -> str:
    """What an attacker's pickle would run on load; here it only creates a file."""
    Path(path).write_text("ran")
    return "pwned"


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_payload, (self.marker,))


def test_checkpoint_with_a_pickled_object_is_refused_and_resume_falls_back(tmp_path, caplog):
    marker = tmp_path / "payload_ran"
    run_dir = tmp_path / "run"
    tiny_tool(run_dir, epochs=2, checkpoint={"every_epochs": 1, "at_end": True}).invoke()
    older, newest = list_checkpoints(run_dir / "checkpoints")
    evil = load_checkpoint(newest)
    evil["payload"] = Payload(marker)  # a well-formed checkpoint plus one arbitrary object
    torch.save(evil, newest)
    control = tmp_path / "control.pt"
    control.write_bytes(newest.read_bytes())

    with pytest.raises(CheckpointError, match=f"checkpoint {newest} is unreadable") as exc:
        load_checkpoint(newest)
    assert "_payload" in str(exc.value)  # torch names the global it refused
    assert not marker.exists()
    # resume skips it (named in the log) and continues from the checkpoint before
    caplog.set_level(logging.WARNING)
    result = tiny_tool(run_dir, epochs=2, checkpoint={"every_epochs": 1}).invoke(resume=True)
    assert not marker.exists()
    assert str(newest) in caplog.text
    assert result.epochs == 2
    assert [r["epoch"] for r in epoch_records(run_dir)] == [1, 2]
    # control: the same bytes loaded without weights_only run the payload
    torch.load(control, weights_only=False)
    assert marker.read_text() == "ran"


def _call_name(node: ast.Call) -> str:
    parts, f = [], node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def test_nothing_is_unpickled_from_disk_without_weights_only():
    """Every ``torch.load`` in the package passes ``weights_only=True``; no pickle,
    dill, joblib, marshal or ``np.load(allow_pickle=True)`` load anywhere."""
    unsafe = {"pickle.load", "pickle.loads", "dill.load", "joblib.load", "marshal.load"}
    torch_loads = []
    for package in ("policy_probes", "trainers", "recipes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                name, where = _call_name(node), f"{path.relative_to(ROOT)}:{node.lineno}"
                kwargs = {k.arg: k.value for k in node.keywords}
                assert name not in unsafe, where
                if name == "torch.load":
                    torch_loads.append(where)
                    flag = kwargs.get("weights_only")
                    assert isinstance(flag, ast.Constant) and flag.value is True, where
                if name in ("np.load", "numpy.load"):
                    flag = kwargs.get("allow_pickle")
                    assert flag is None or (isinstance(flag, ast.Constant) and not flag.value)
    assert torch_loads  # the scan found the checkpoint loader, so it is not vacuous
