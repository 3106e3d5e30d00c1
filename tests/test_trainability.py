"""Trainability probe (Lyle, Rowland, Dabney, ICLR 2022): a copy of the component fits
standardised outputs of a random network for k Adam steps, against fresh initialisations.

The loss, the fresh baseline and their ratio are checked against the same fit written out
in plain torch here (seeds, targets, heads, Adam loop); a component whose units are all
dead fits worse than fresh networks, a fresh one about as well; training is bit-identical
with and without the probe; the cached baseline survives a checkpoint and a resume; the
``policy-probes trainability`` command on a checkpoint gives the probe's numbers of that
epoch; bad settings and inputs get clear errors."""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path

import pytest
import torch
from conftest import cli_error_line
from run_control_support import StopAfter
from torch import nn

from policy_probes import (
    ComponentContext,
    MLPSpec,
    PolicyAutoBuilder,
    StatsReporter,
    attach_trainability_hooks,
)
from policy_probes.cli import main
from policy_probes.probes.trainability import Trainability
from policy_probes.reference_states import ReferenceStates
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainTool

torch.set_num_threads(1)
EPOCHS = 4


class Net(PolicyAutoBuilder):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__({"body": MLPSpec(in_features=3, hidden_sizes=[hidden, hidden])})

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body(obs)


def probed(net: nn.Module, obs: torch.Tensor, **settings) -> ComponentContext:
    """``net`` with the probe on ``body`` and ``obs`` as the reference states."""
    ctx = ComponentContext()
    ctx.reference_states = ReferenceStates()
    net.attach("body", attach_trainability_hooks(**settings), ctx)
    ctx.reference_states.fix(obs)
    ctx.reference_states.forward = net
    return ctx


# ------------------------------------------------------------- the fit, written out
def seed_of(seed: int, name: str, draw: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 101 + draw) % (2**63)


def plain_body(spec_net: Net) -> nn.Module:
    """The component's architecture and parameters, built anew (no hooks)."""
    body = MLPSpec(in_features=3, hidden_sizes=[16, 16]).build()
    body.load_state_dict(spec_net.body.state_dict())
    return body


def reinitialised(body: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    fresh = copy.deepcopy(body)
    for m in fresh.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    return fresh


def plain_fit(body: nn.Module, x, y, steps: int, lr: float, head_seed: int) -> float:
    torch.manual_seed(head_seed)
    head = nn.Linear(16, y.shape[1])
    opt = torch.optim.Adam([*body.parameters(), *head.parameters()], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        ((head(body(x)) - y) ** 2).mean().backward()
        opt.step()
    with torch.no_grad():
        return float(((head(body(x)) - y) ** 2).mean())


def plain_measure(net: Net, x, *, steps, lr, targets, fresh, seed, name="body"):
    body = plain_body(net)
    with torch.no_grad():
        target_net = reinitialised(body, seed_of(seed, name, 0))
        lin = nn.Linear(16, targets)  # drawn after the target network's reset
        raw = lin(target_net(x))
        mean = raw.mean(0)
        std = ((raw - mean) ** 2).mean(0).sqrt()
        y = (raw - mean) / std
    loss = plain_fit(copy.deepcopy(body), x, y, steps, lr, seed_of(seed, name, 1))
    fresh_losses = [
        plain_fit(
            reinitialised(body, seed_of(seed, name, 2 + 2 * i)),
            x,
            y,
            steps,
            lr,
            seed_of(seed, name, 3 + 2 * i),
        )
        for i in range(fresh)
    ]
    return loss, sum(fresh_losses) / fresh


def test_loss_and_fresh_baseline_match_the_fit_written_out() -> None:
    torch.manual_seed(0)
    net = Net()
    obs = torch.randn(40, 3)
    settings = {"steps": 30, "lr": 3e-3, "targets": 5, "fresh": 2, "seed": 7}
    ctx = probed(net, obs, **settings, reference_rows=40)
    before = copy.deepcopy(net.state_dict())
    rng = torch.get_rng_state()
    got = StatsReporter(ctx).collect()
    assert torch.equal(torch.get_rng_state(), rng)  # the loop's generator is untouched
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    loss, fresh = plain_measure(net, obs, **settings)
    assert got["probes/trainability/body/loss"] == pytest.approx(loss, rel=1e-5)
    assert got["probes/trainability/body/fresh_loss"] == pytest.approx(fresh, rel=1e-5)
    assert got["probes/trainability/body/ratio"] == pytest.approx(loss / fresh, rel=1e-5)
    assert 0 < loss < 1  # standardised targets: a constant predictor scores 1


def test_only_every_epochs_and_the_first_report_measure() -> None:
    torch.manual_seed(1)
    net = Net()
    ctx = probed(net, torch.randn(20, 3), steps=2, fresh=1, every_epochs=3)
    reports = [StatsReporter(ctx).collect() for _ in range(7)]
    measured = [i + 1 for i, r in enumerate(reports) if "probes/trainability/body/loss" in r]
    assert measured == [1, 3, 6]


def test_dead_units_fit_worse_than_fresh_networks_and_a_fresh_component_as_well() -> None:
    torch.manual_seed(2)
    obs = torch.randn(128, 3)
    settings = {"steps": 150, "lr": 1e-2, "fresh": 3}
    dead = Net()
    with torch.no_grad():
        dead.body.layer_0.linear.bias.fill_(-100.0)  # every unit of layer 0 is off everywhere
    got = StatsReporter(probed(dead, obs, **settings)).collect()
    # nothing reaches the head: it fits the targets' mean (0), scoring 1
    assert got["probes/trainability/body/loss"] == pytest.approx(1.0, abs=1e-4)
    assert got["probes/trainability/body/ratio"] > 2.0
    fresh = StatsReporter(probed(Net(), obs, **settings)).collect()
    assert 0.5 < fresh["probes/trainability/body/ratio"] < 1.5


def test_the_cached_baseline_travels_in_the_state_dict() -> None:
    torch.manual_seed(3)
    net = Net()
    obs = torch.randn(30, 3)
    ctx = probed(net, obs, steps=5, fresh=2, every_epochs=1)
    first = StatsReporter(ctx).collect()
    tracker = ctx.model_metrics["trainability"]
    saved = tracker.state_dict()
    assert set(saved["fresh"]) == {"body"}
    loaded = probed(net, obs, steps=5, fresh=2, every_epochs=1)
    other = loaded.model_metrics["trainability"]
    assert isinstance(other, Trainability)
    other.load_state_dict(saved)
    assert torch.equal(other.fresh["body"], tracker.fresh["body"])
    again = StatsReporter(loaded).collect()
    recomputed = StatsReporter(probed(net, obs, steps=5, fresh=2, every_epochs=1)).collect()
    for key in ("loss", "fresh_loss", "ratio"):
        k = f"probes/trainability/body/{key}"
        assert again[k] == first[k] == recomputed[k]
    # a baseline saved with other settings is not reused
    changed = probed(net, obs, steps=6, fresh=2, every_epochs=1)
    changed.model_metrics["trainability"].load_state_dict(saved)
    assert "body" not in changed.model_metrics["trainability"].fresh


# ------------------------------------------------------------- through the trainer
def tool(run_dir: Path, probe: bool = True) -> TrainTool:
    t = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[16, 16], activation="relu"),
        trainer=PPOConfig(
            total_timesteps=2 * 32 * EPOCHS, num_steps=32, num_minibatches=2, update_epochs=2
        ),
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 1, "keep_last": 10},
        sinks={"console": False, "wandb": False, "tensorboard": False},
        torch_threads=1,
        seed=5,
        run_dir=run_dir,
    )
    if probe:
        for component in ("actor_mlp", "critic_mlp"):
            t.add_training_hook(component, attach_trainability_hooks(steps=10, every_epochs=2))
    return t


def records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {r["epoch"]: r for r in rows if r.get("point", "POST_EPOCH") == "POST_EPOCH"}


def trainability_keys(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("probes/trainability/")}


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory) -> tuple[Path, TrainTool, object]:
    run_dir = tmp_path_factory.mktemp("trainability") / "probed"
    t = tool(run_dir)
    return run_dir, t, t.invoke()


def test_training_is_bit_identical_with_and_without_the_probe(probed_run, tmp_path) -> None:
    run_dir, _, with_probe = probed_run
    without = tool(tmp_path / "plain", probe=False).invoke()
    a, b = with_probe.policy.state_dict(), without.policy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = records(run_dir)
    assert [e for e in rows if "probes/trainability/actor_mlp/ratio" in rows[e]] == [1, 2, 4]
    assert not any(k.startswith("probes/errors/") for r in rows.values() for k in r)


def test_a_resumed_run_reports_the_same_numbers(probed_run, tmp_path) -> None:
    run_dir, _, _ = probed_run
    stopped = tool(tmp_path / "resumed").add_trainer_hook(StopAfter(3)).invoke()
    assert stopped.epochs == 3
    tool(tmp_path / "resumed").invoke(resume=True)
    plain, resumed = records(run_dir), records(tmp_path / "resumed")
    for epoch in (1, 2, 4):
        assert trainability_keys(resumed[epoch]) == trainability_keys(plain[epoch])
        assert trainability_keys(plain[epoch])


RECIPE = """
from policy_probes import attach_trainability_hooks
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainTool


def train() -> TrainTool:
    t = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[16, 16], activation="relu"),
        trainer=PPOConfig(total_timesteps=192, num_steps=32, num_minibatches=2, update_epochs=2),
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 1, "keep_last": 10},
        sinks={"console": False, "wandb": False, "tensorboard": False},
        torch_threads=1,
        seed=3,
    )
    t.add_training_hook("critic_mlp", attach_trainability_hooks(steps=10, every_epochs=1))
    return t


def plain() -> TrainTool:
    t = train()
    return TrainTool.model_validate(t.model_dump())
"""


def test_the_command_on_a_checkpoint_gives_the_probes_numbers(tmp_path, capsys) -> None:
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "run"
    assert main(["run", f"{recipe}:train", f"run_dir={run_dir}", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["trainability", str(run_dir), "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    logged = records(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for row in rows:
        record = logged[row["epoch"]]
        for key in ("loss", "fresh_loss", "ratio"):
            assert row[key] == pytest.approx(
                record[f"probes/trainability/critic_mlp/{key}"], rel=1e-12
            )
    assert main(["trainability", str(run_dir), "--epoch", "2"]) == 0
    text = capsys.readouterr().out
    assert (
        "critic_mlp" in text and f"{logged[2]['probes/trainability/critic_mlp/ratio']:.3f}" in text
    )
    # bad input: one clear line each
    line = cli_error_line(capsys, "trainability", str(run_dir), "--epoch", "9")
    assert "no checkpoint of the end of epoch 9" in line and "1, 2, 3" in line
    line = cli_error_line(capsys, "trainability", str(run_dir), "--components", "nothing")
    assert "no component 'nothing'" in line and "critic_mlp" in line
    line = cli_error_line(capsys, "trainability", str(tmp_path / "absent"))
    assert "does not exist" in line
    # a run without the probe has no reference states in its checkpoints
    bare = tmp_path / "bare"
    assert main(["run", f"{recipe}:plain", f"run_dir={bare}", "--no-progress"]) == 0
    line = cli_error_line(capsys, "trainability", str(bare), "--components", "critic_mlp")
    assert "holds no reference states" in line and "fork" in line
    line = cli_error_line(capsys, "trainability", str(bare))
    assert "did not attach the trainability probe" in line and "--components" in line


class Recurrent(PolicyAutoBuilder):
    def __init__(self) -> None:
        super().__init__({"rnn": nn.GRU(3, 4), "body": MLPSpec(in_features=3, hidden_sizes=[4])})

    def forward(self, obs: torch.Tensor):
        return self.rnn(obs.unsqueeze(0))[0], self.body(obs)


def test_bad_settings_and_inputs_say_what_to_change() -> None:
    for bad, word in (({"steps": 0}, "steps"), ({"lr": -1.0}, "lr"), ({"fresh": 1.5}, "fresh")):
        with pytest.raises(ValueError, match=word):
            attach_trainability_hooks(**bad)
    torch.manual_seed(4)
    net = Recurrent()
    ctx = ComponentContext()
    ctx.reference_states = ReferenceStates()
    for component in ("rnn", "body"):
        net.attach(component, attach_trainability_hooks(steps=2, fresh=1), ctx)
    ctx.reference_states.fix(torch.randn(10, 3))
    ctx.reference_states.forward = net
    got = StatsReporter(ctx).collect()
    assert "probes/trainability/body/ratio" in got  # the other component is measured
    assert "probes/trainability/rnn/loss" not in got
    assert got["probes/errors/trainability/rnn"] == 1.0
    assert "not batch-first" in ctx.probe_errors["trainability/rnn"]
    # without reference states: said once, nothing measured, nothing fails
    lone = ComponentContext()
    Net().attach("body", attach_trainability_hooks(), lone)
    got = StatsReporter(lone).collect()
    assert "no reference states" in lone.probe_errors["trainability/body"]
    assert not any(k.startswith("probes/trainability/") for k in got)


def test_the_cost_benchmark_adds_the_probe_at_its_defaults_to_the_recipe() -> None:
    from benchmarks import trainability_cost
    from policy_probes.plugins import from_spec

    (comp,) = trainability_cost.comparisons(quick=False)
    assert comp.a.case == comp.b.case == "recipe"
    assert comp.b.params == {**comp.a.params, "extra_probes": trainability_cost.SPECS}
    assert comp.a.params["total_timesteps"] == 200_000 and comp.a.params["probes"]
    for spec in trainability_cost.SPECS:
        component, probe, placement = from_spec(spec, "probe")
        assert component in ("actor_mlp", "critic_mlp") and placement == {}
        assert isinstance(probe, Trainability) and probe.options["every_epochs"] == 50


def test_the_copy_carries_no_hook_and_fires_no_probe() -> None:
    from policy_probes import attach_relu_activation_hooks
    from policy_probes.probes.trainability import hook_free_copy

    torch.manual_seed(5)
    net = Net()
    ctx = ComponentContext()
    net.attach("body", attach_relu_activation_hooks(), ctx)
    assert net.body._forward_hooks  # armed in the training phase
    twin = hook_free_copy(net.body)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in twin.modules())
    assert all(p is not q for p, q in zip(twin.parameters(), net.body.parameters(), strict=True))
    twin(torch.randn(8, 3))
    assert not any(k.startswith("probes/relu/") for k in StatsReporter(ctx).collect())
    net.body(torch.randn(8, 3))  # the original still records
    assert "probes/relu/body/dead_fraction" in StatsReporter(ctx).collect()
