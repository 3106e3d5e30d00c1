"""A complete probe of one's own, in this one file: its measurement, its findings rule,
its console default and its registration; and a sink and a remedy of one's own. They are
selected like the built-in ones and run through the three drivers (the built-in trainer, the
Stable-Baselines3 callback and a CleanRL-style loop) without touching another file
(docs/components.md walks through it)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import sb3_cartpole
from rich.console import Console
from torch import nn

from policy_probes import ProbeSession, ProbeSettings, Rule, Run, plugins, register
from policy_probes.analysis.findings import diagnose_run
from policy_probes.cli import main
from policy_probes.integrations.sb3 import ProbeCallback
from policy_probes.overrides import apply_overrides
from policy_probes.probes.probe import Probe
from policy_probes.probes.state import COUNT, as_floats, as_rows, unit_rates
from policy_probes.probes.weighted import Weighted
from policy_probes.records import Record, read_jsonl
from policy_probes.remedies.base import Remedy
from policy_probes.sinks import (
    ConsoleSink,
    MetricSink,
    SinksConfig,
    WandbConfig,
    default_console_metrics,
)
from trainers import TrainTool

torch.set_num_threads(1)


@register
class PositiveShare(Probe):
    """The share of a component's output elements that are positive, per unit and
    overall: a cheap view of how much of a layer is switched on."""

    name = "positive_share"
    placements = ("phases", "extractor", "schedule")
    metrics = {
        "positive_rate": "per unit: the share of rows where it is positive",
        "positive_share": "the share of positive elements over every unit",
    }
    console = ("positive_share",)
    rules = (
        Rule(
            name="outputs_switching_off",
            title="the component's outputs are switching off",
            metric="positive_share",
            direction="falling",
            kind="level",
            threshold=0.5,
            min_change=0.25,
            threshold_source="this test's own",
            docs="tests/test_own_probe.py",
            remedies=("redo",),
            meaning="fewer and fewer outputs are positive",
        ),
    )
    docs = "tests/test_own_probe.py"

    def record(self, obs, module, output, weight) -> None:
        self._push(obs.component, "h", (as_rows(output),), weight=weight)

    def consume(self, batch) -> None:
        (h,) = batch.cols
        kept = Weighted(h, batch.weight)
        self._add(batch.component, "positive", kept.counts(h.positive()), COUNT)
        self._add(batch.component, "count", kept.finite_count(), COUNT)

    def summarize(self, component, s, settings) -> dict:
        positive, count = s["positive"].numpy(), s["count"].numpy()
        return {
            "positive_rate": as_floats(torch.from_numpy(unit_rates(positive, count))),
            "positive_share": float(positive.sum() / count.sum()) if count.sum() else 0.0,
        }


@register
class Recorder(MetricSink):
    """Keeps every record it is handed (a sink of one's own, selected by configuration)."""

    name = "recorder"
    seen: list[Record] = []

    def emit(self, record: Record) -> None:
        type(self).seen.append(record)


@register
class ScaleBiases(Remedy):
    """Scales the biases of a component's linear layers by ``factor`` (a remedy of one's
    own, selected by configuration)."""

    name = "scale_biases"
    #: (bias before, bias after) of every application
    applied: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __init__(self, *, factor: float = 0.5, **trigger) -> None:
        super().__init__(**trigger)
        self.factor = factor

    def prepare(self, target):
        return [m for m in target.module.modules() if isinstance(m, nn.Linear)]

    def apply(self, target, prepared, generator):
        for linear in prepared:
            before = linear.bias.detach().clone()
            with torch.no_grad():
                linear.bias.mul_(self.factor)
            type(self).applied.append((before, linear.bias.detach().clone()))
        return {target.component: sum(linear.bias.numel() for linear in prepared)}

    def settings(self) -> dict:
        return {"factor": self.factor}


@pytest.fixture(autouse=True)
def _fresh_recorder():
    Recorder.seen, ScaleBiases.applied = [], []
    yield


SINKS = SinksConfig(console=False, csv=False, wandb=False, recorder=True)
NO_WANDB = WandbConfig(mode="disabled")
EVERY_PASS = {"probe_budget": None}


def test_it_is_registered_and_its_declarations_reach_the_findings_and_the_console() -> None:
    assert plugins.get("probe", "positive_share") is PositiveShare
    assert plugins.get("sink", "recorder") is Recorder
    (rule,) = [r for r in plugins.findings_rules() if r.name == "outputs_switching_off"]
    assert rule.probe == "positive_share"
    assert rule.matches("probes/positive_share/actor_mlp/positive_share") == "actor_mlp"
    assert "probes/positive_share/*/positive_share" in default_console_metrics()
    # a sink of one's own is a configuration key like a built-in one
    tool = apply_overrides(TrainTool(), ["sinks.recorder=true", "sinks.jsonl=false"])
    assert tool.sinks.enabled("recorder") and not tool.sinks.enabled("jsonl")
    assert not TrainTool().sinks.enabled("recorder")  # off unless switched on
    with pytest.raises(Exception, match="unknown configuration key 'sinks.recordr'"):
        apply_overrides(TrainTool(), ["sinks.recordr=true"])


def expected_rates(records: list[dict], component: str) -> list[tuple[list[float], float]]:
    """The built-in relu probe's active rate of the same rows: an independent count of
    the positive elements (``relu`` counts h > 0 with its own reduction)."""
    out = []
    for r in records:
        rate = r.get(f"probes/relu/{component}/active_rate")
        if rate is not None:
            out.append((rate, sum(rate) / len(rate)))
    return out


def check_against_relu(records: list[dict], component: str) -> None:
    epochs = [r for r in records if f"probes/positive_share/{component}/positive_rate" in r]
    assert epochs and len(epochs) == len(expected_rates(records, component))
    for r, (rate, share) in zip(epochs, expected_rates(records, component), strict=True):
        assert r[f"probes/positive_share/{component}/positive_rate"] == pytest.approx(rate)
        # equal rows per unit, so the share is the mean of the units' rates
        assert r[f"probes/positive_share/{component}/positive_share"] == pytest.approx(share)


def test_the_built_in_trainer_runs_it_from_configuration(tmp_path: Path) -> None:
    tool = TrainTool(
        run_dir=tmp_path / "run",
        env={"num_envs": 2},
        policy={"hidden_sizes": [16], "activation": "relu"},
        trainer={"total_timesteps": 3 * 32, "num_steps": 16, "num_minibatches": 2},
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 0, "at_end": False},
        sinks={**SINKS.model_dump(), "jsonl": True},
        wandb=NO_WANDB,
        probes=["positive_share@actor_mlp", "relu@actor_mlp:per_layer=false"],
        remedies=["scale_biases@actor_mlp:factor=0.25,every_epochs=2"],
        torch_threads=1,
        **EVERY_PASS,
    )
    tool.invoke()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    check_against_relu(records, "actor_mlp")
    # the remedy of one's own fired where its trigger says, and did what it says
    fired = [r.get("remedies/scale_biases/actor_mlp/fired") for r in records]
    assert fired == [0.0, 1.0, 0.0]
    assert len(ScaleBiases.applied) == 1  # the policy's one hidden layer, once
    for before, after in ScaleBiases.applied:
        torch.testing.assert_close(after, before * 0.25)
    # the sink of one's own got every record the JSONL file holds
    assert [(r.epoch, r.hook_point) for r in Recorder.seen] == [
        (r["epoch"], r["hook_point"]) for r in records
    ]
    key = "probes/positive_share/actor_mlp/positive_share"
    assert [r.metrics.get(key) for r in Recorder.seen] == [r.get(key) for r in records]


def test_the_sb3_callback_runs_it(tmp_path: Path) -> None:
    model = sb3_cartpole(activation_fn=nn.ReLU)
    callback = ProbeCallback(
        probes=[("actor_mlp", PositiveShare()), ("actor_mlp", plugins.get("probe", "relu")())],
        run_dir=tmp_path / "run",
        probing=ProbeSettings(
            sinks={**SINKS.model_dump(), "jsonl": True}, wandb=NO_WANDB, **EVERY_PASS
        ),
    )
    model.learn(3 * 2 * 16, callback=callback)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    check_against_relu(records, "actor_mlp")
    assert Recorder.seen and len(Recorder.seen) == len(records)


def switching_off_run(run_dir: Path, epochs: int) -> tuple[list[dict], list[dict]]:
    """A CleanRL-style loop whose ReLU layer is driven off: every unit is positive for
    the first two thirds of the run, then only for the rows of a shrinking share of inputs.
    Returns the records and the findings the session handed the sinks at the end."""
    layer = nn.Sequential(nn.Linear(1, 8), nn.ReLU())
    with torch.no_grad():
        layer[0].weight.fill_(1.0)
        layer[0].bias.zero_()
    agent = nn.ModuleDict({"actor_mlp": layer})
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.0)  # the weights stay put
    probing = ProbeSettings(
        sinks=SINKS.model_copy(update={"jsonl": True}), wandb=NO_WANDB, **EVERY_PASS
    )
    expected = []
    with ProbeSession(agent, run=Run(run_dir), probing=probing, optimizer=optimizer) as session:
        session.add_training_hook("actor_mlp", PositiveShare())
        for epoch in range(epochs):
            on = 2 * epochs // 3
            positive = 1.0 if epoch < on else max(0.0, 1.0 - 0.1 * (epoch - on))
            rows = 40
            x = torch.where(torch.arange(rows) < round(positive * rows), 1.0, -1.0)[:, None]
            with session.phase("train"):
                for mb in x.split(20):
                    loss = layer(mb).sum()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            with torch.no_grad():  # independent: the layer's output recomputed by hand
                h = torch.relu(x @ layer[0].weight.T + layer[0].bias)
            expected.append(((h > 0).double().mean(0).tolist(), float((h > 0).double().mean())))
            session.epoch_end(step=(epoch + 1) * rows)
    records = read_jsonl(run_dir / "metrics.jsonl")
    ours = [
        (
            r["probes/positive_share/actor_mlp/positive_rate"],
            r["probes/positive_share/actor_mlp/positive_share"],
        )
        for r in records
        if r["hook_point"] == "POST_EPOCH"
    ]
    assert len(ours) == len(expected)
    for (rate, share), (want_rate, want_share) in zip(ours, expected, strict=True):
        assert rate == pytest.approx(want_rate) and share == pytest.approx(want_share)
    return records, list(Recorder.seen[-1].findings)


def test_a_cleanrl_style_loop_runs_it_and_its_rule_becomes_a_finding(tmp_path, capsys) -> None:
    records, handed = switching_off_run(tmp_path / "run", epochs=60)
    (finding,) = handed
    assert finding["rule"] == "outputs_switching_off" and finding["component"] == "actor_mlp"
    assert finding["baseline"] == 1.0 and finding["value"] <= 0.5
    # the onset: the first epoch whose own value is at most the threshold, in the stretch
    shares = [r["probes/positive_share/actor_mlp/positive_share"] for r in records]
    assert finding["onset_epoch"] == 1 + next(i for i, v in enumerate(shares) if v <= 0.5)
    # diagnose reads the same rule from the registry, from the file
    assert [f.to_dict() for f in diagnose_run(tmp_path / "run")] == handed
    assert main(["diagnose", str(tmp_path / "run"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["findings"]
    assert [f["rule"] for f in listed] == ["outputs_switching_off"]
    # the run recorded the module that registered the rule: a fresh process applies it
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["plugin_modules"] == ["test_own_probe"]
    command = [sys.executable, "-m", "policy_probes.cli", "diagnose", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True)
    assert [f["rule"] for f in json.loads(done.stdout)["findings"]] == ["outputs_switching_off"]
    # where the module cannot be imported, a warning says so
    env["PYTHONPATH"] = str(Path(__file__).parents[1])  # the project, not tests/
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert "'test_own_probe' could not be imported" in done.stderr


def test_the_console_follows_it_by_default(tmp_path: Path) -> None:
    out = io.StringIO()
    sink = ConsoleSink(console=Console(file=out, width=200), live=False)
    sink.emit(Record.of({"probes/positive_share/actor_mlp/positive_share": 0.25}, 1, "SNAPSHOT", 8))
    sink.close()
    assert "probes/positive_share/actor_mlp/positive_share" in out.getvalue()
    assert "0.25" in out.getvalue()
