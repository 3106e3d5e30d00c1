"""The run's reference states and the unit scores on them (``_ref`` keys).

The set is the first rollout's evenly spaced rows (indices computed here in Python
integers), or rows the user fixes; a checkpoint carries it, so a resumed run and a fork
measure on the same states. ``dead_fraction_ref``, ``dormant_fraction_ref`` (relu) and
``low_utility_fraction_ref`` (utility) equal the formulas computed here in plain torch on
the same observations and weights, for a component and every layer it reports, dense and
conv, including a unit dead on the epoch's rows but alive on the set. Measuring them
never changes training (bit-identical parameters and every other key), and a loop that
never hands a rollout over reports no ``_ref`` key and says so once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import JSONL_ONLY
from run_control_support import write_recipe
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeSettings,
    StatsReporter,
    attach_relu_activation_hooks,
    attach_utility_hooks,
)
from policy_probes.cli import apply_overrides
from policy_probes.recipe_launch import build_from_recipe
from policy_probes.records import read_jsonl
from policy_probes.reference_states import ReferenceStates
from policy_probes.runnable import ForkPoint
from policy_probes.session import ProbeSession
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainerHook, TrainTool
from trainers.checkpoint import list_checkpoints, load_checkpoint

torch.set_num_threads(1)

TAU = 0.025  # the probes' default
REDO_EPS = 1e-9  # ReDo: s_i / (mean_j s_j + 1e-9)
UTILITY_EPS = 1e-12
SIZE = 512  # the set's default size
WALL_CLOCK = ("time", "perf/", "probes/overhead_")


def expected_rows(observations: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    """Rows floor(i (R - 1) / (size - 1)) of R, in Python integers (all when R <= size)."""
    rows = observations.shape[0]
    if rows <= size:
        return observations
    return observations[[i * (rows - 1) // (size - 1) for i in range(size)]]


def session_for(model: nn.Module, run_dir: Path) -> ProbeSession:
    """Every pass observed, records in metrics.jsonl only."""
    return ProbeSession(
        model, run=run_dir, probing=ProbeSettings(sinks=JSONL_ONLY, probe_budget=None)
    )


# ----------------------------------------------------------------- hand computations
def units(h: torch.Tensor) -> torch.Tensor:
    """(rows, units): a conv output's channels are its units, every position a row."""
    return h.movedim(1, -1).reshape(-1, h.shape[1]) if h.dim() > 2 else h


def dead_share(h: torch.Tensor) -> float:
    """Share of units not positive on any row."""
    return (units(h) <= 0).all(0).double().mean().item()


def dormant_share(h: torch.Tensor, tau: float = TAU) -> float:
    """ReDo (Sokar et al. 2023): s_i = mean|h_i| / (mean_k mean|h_k| + 1e-9) <= tau."""
    s = units(h).double().abs().mean(0)
    return (s / (s.mean() + REDO_EPS) <= tau).double().mean().item()


def low_utility_share(h: torch.Tensor, out_sum: torch.Tensor, tau: float = TAU) -> float:
    """Dohare et al. 2024's contribution |h_i| sum_k |w_ki|, its mean over the rows, at
    most tau of the layer mean."""
    c = units(h).double().abs().mean(0) * out_sum.double()
    return (c / (c.mean() + UTILITY_EPS) <= tau).double().mean().item()


# ----------------------------------------------------------------- models
class DenseNet(nn.Module):
    """``body`` = Linear 2->4, ReLU, Linear 4->5, ReLU; ``head`` = Linear 5->2. Unit 0 of
    the first layer is x0 (alive only where x0 > 0), unit 3 is dead on [-1, 1]^2."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 5), nn.ReLU())
        self.head = nn.Linear(5, 2)
        with torch.no_grad():
            self.body[0].weight.copy_(torch.tensor([[1.0, 0], [-0.5, 0.3], [0.2, 1.0], [1, 1]]))
            self.body[0].bias.copy_(torch.tensor([0.0, 0.1, 0.0, -5.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ConvNet(nn.Module):
    """``enc`` = Conv2d 1->3 (2x2), ReLU, Flatten, Linear 12->4, ReLU; ``head`` = Linear 4->2
    on 1x3x3 frames."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(1, 3, 2), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4), nn.ReLU()
        )
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def one_epoch(
    model: nn.Module, run_dir: Path, rollout: torch.Tensor | None, train: torch.Tensor, **attach
) -> tuple[dict, ProbeSession]:
    """One epoch: the rollout handed over (if any), one training forward on ``train``."""
    name = next(iter(dict(model.named_children())))
    session = session_for(model, run_dir)
    session.add_training_hook(name, attach_relu_activation_hooks(**attach))
    session.add_training_hook(name, attach_utility_hooks(outgoing="head", **attach))
    if rollout is not None:
        session.rollout_end(observations=rollout)
    with session.phase("train"):
        model(train).sum().backward()
    return session.epoch_end(step=1), session


# ----------------------------------------------------------------- the set
def test_the_set_is_the_first_rollouts_evenly_spaced_rows(tmp_path):
    torch.manual_seed(0)
    model = DenseNet()
    first, second = torch.randn(1000, 2), torch.randn(1000, 2)
    with session_for(model, tmp_path / "run") as session:
        session.add_training_hook("body", attach_relu_activation_hooks())
        assert session.wants_observations
        session.rollout_end(observations=first)
        session.epoch_end(step=1)
        session.rollout_end(observations=second)
        states = session.context.reference_states
        assert torch.equal(states.observations, expected_rows(first))
        assert states.observations.shape == (SIZE, 2)
        assert (states.source, states.chosen_at) == ("first rollout", 0)
    # fewer rows than the set's size: all of them
    with session_for(DenseNet(), tmp_path / "small") as session:
        session.add_training_hook("body", attach_relu_activation_hooks())
        session.rollout_end(observations=first[:300])
        assert torch.equal(session.context.reference_states.observations, first[:300])


def test_fixed_states_replace_the_first_rollout_and_a_checkpoint_carries_them(tmp_path):
    torch.manual_seed(1)
    given, rollout = torch.randn(40, 2), torch.randn(1000, 2)
    with session_for(DenseNet(), tmp_path / "run") as session:
        session.add_training_hook("body", attach_relu_activation_hooks())
        session.fix_reference_states(given)
        session.rollout_end(observations=rollout)
        states = session.context.reference_states
        assert torch.equal(states.observations, given) and states.source == "given"
        saved = session.state_dict()
    with session_for(DenseNet(), tmp_path / "again") as resumed:
        resumed.add_training_hook("body", attach_relu_activation_hooks())
        resumed.load_state_dict(saved)
        resumed.rollout_end(observations=torch.randn(1000, 2))  # not taken: the set is set
        states = resumed.context.reference_states
        assert torch.equal(states.observations, given)
        assert (states.source, states.chosen_at) == ("given", 0) and states.ready


class FirstRollout(TrainerHook):
    """Keeps the first rollout's observations, one row per valid transition."""

    def __init__(self) -> None:
        self.observations: torch.Tensor | None = None

    def on_rollout_end(self, state) -> None:
        if self.observations is None:
            self.observations = state.trainer.storage.valid_observations().clone()


def saved_set(checkpoint: Path) -> torch.Tensor:
    return load_checkpoint(checkpoint)["session"]["reference_states"]["observations"]


def test_resume_and_fork_keep_the_first_runs_set(tmp_path):
    target = write_recipe(tmp_path)  # 6 epochs of 64 transitions, relu on actor_mlp
    parent = tmp_path / "parent"
    tool = apply_overrides(
        build_from_recipe(target), [f"run_dir={parent}", "checkpoint.every_epochs=1"]
    )
    first = FirstRollout()
    tool.add_trainer_hook(first)
    tool.invoke()
    expected = expected_rows(first.observations)
    checkpoints = list_checkpoints(parent / "checkpoints")
    assert len(checkpoints) == 6
    for checkpoint in checkpoints:
        assert torch.equal(saved_set(checkpoint), expected)

    # a fork from epoch 3 measures on the parent's set: the same _ref values as the parent
    child = tmp_path / "child"
    apply_overrides(build_from_recipe(target), [f"run_dir={child}"]).invoke(
        fork_from=ForkPoint(parent, 3)
    )
    assert torch.equal(saved_set(list_checkpoints(child / "checkpoints")[-1]), expected)
    later = [r for r in read_jsonl(parent / "metrics.jsonl") if r["epoch"] > 3]
    mine = read_jsonl(child / "metrics.jsonl")
    ref = "probes/relu/actor_mlp/dead_fraction_ref"
    assert all(ref in r for r in later if r["hook_point"] == "POST_EPOCH")
    for a, b in zip(mine, later, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(WALL_CLOCK)} == {
            k: v for k, v in b.items() if not k.startswith(WALL_CLOCK)
        }

    # a run stopped after 2 epochs and resumed keeps the set of its first rollout
    stopped = tmp_path / "stopped"
    short = apply_overrides(
        build_from_recipe(target), [f"run_dir={stopped}", "trainer.total_timesteps=128"]
    )
    short.invoke()
    apply_overrides(
        build_from_recipe(target), [f"run_dir={stopped}", "trainer.total_timesteps=256"]
    ).invoke(resume=True)
    assert torch.equal(saved_set(list_checkpoints(stopped / "checkpoints")[-1]), expected)


# ----------------------------------------------------------------- the scores
def test_dense_scores_on_the_set_equal_the_formulas(tmp_path):
    torch.manual_seed(2)
    model = DenseNet()
    train = torch.rand(64, 2) * torch.tensor([-1.0, 2.0]) + torch.tensor([0.0, -1.0])
    rollout = torch.rand(700, 2) * 2 - 1  # x0 on both sides of 0
    metrics, session = one_epoch(model, tmp_path / "run", rollout, train)
    session.close()
    ref = expected_rows(rollout)
    with torch.no_grad():
        h1 = model.body[:2](ref)
        h3 = model.body(ref)
        h1_train = model.body[:2](train)
    # unit 0 (x0) is dead on the epoch's rows (x0 <= 0) but alive on the set
    assert (h1_train[:, 0] <= 0).all() and (h1[:, 0] > 0).any()
    relu = "probes/relu/"
    assert metrics[relu + "body.1/dead_fraction"] == 0.5  # units 0 and 3
    assert metrics[relu + "body.1/dead_fraction_ref"] == pytest.approx(dead_share(h1)) == 0.25
    for name, h in (("body.1", h1), ("body.3", h3), ("body", h3)):
        assert metrics[f"{relu}{name}/dead_fraction_ref"] == pytest.approx(dead_share(h))
        assert metrics[f"{relu}{name}/dormant_fraction_ref"] == pytest.approx(dormant_share(h))
    utility = "probes/utility/"
    weights = {"body.1": model.body[2].weight, "body.3": model.head.weight}
    for name, h in (("body.1", h1), ("body.3", h3)):
        out_sum = weights[name].detach().abs().sum(0)
        assert metrics[f"{utility}{name}/low_utility_fraction_ref"] == pytest.approx(
            low_utility_share(h, out_sum)
        )
    assert metrics[utility + "body.1/low_utility_fraction_ref"] == 0.25  # unit 3 only


def test_conv_scores_on_the_set_read_channels(tmp_path):
    torch.manual_seed(3)
    model = ConvNet()
    rollout, train = torch.randn(600, 1, 3, 3), torch.randn(32, 1, 3, 3)
    metrics, session = one_epoch(model, tmp_path / "run", rollout, train)
    session.close()
    ref = expected_rows(rollout)
    with torch.no_grad():
        conv = model.enc[:2](ref)  # (B, 3, 2, 2): 3 units
        dense = model.enc(ref)
    assert conv.shape[1:] == (3, 2, 2)
    relu = "probes/relu/"
    for name, h in (("enc.1", conv), ("enc.4", dense), ("enc", dense)):
        assert metrics[f"{relu}{name}/dead_fraction_ref"] == pytest.approx(dead_share(h))
        assert metrics[f"{relu}{name}/dormant_fraction_ref"] == pytest.approx(dormant_share(h))
    # channel c's outgoing weights: the Linear's columns of its 4 positions (channel-major)
    conv_out = model.enc[3].weight.detach().abs().sum(0).view(3, 4).sum(1)
    head_out = model.head.weight.detach().abs().sum(0)
    assert metrics["probes/utility/enc.1/low_utility_fraction_ref"] == pytest.approx(
        low_utility_share(conv, conv_out)
    )
    assert metrics["probes/utility/enc.4/low_utility_fraction_ref"] == pytest.approx(
        low_utility_share(dense, head_out)
    )


def test_reference_false_reports_no_ref_key_and_asks_for_no_rollout(tmp_path):
    torch.manual_seed(4)
    model = DenseNet()
    with session_for(model, tmp_path / "run") as session:
        session.add_training_hook("body", attach_relu_activation_hooks(reference=False))
        session.add_training_hook("body", attach_utility_hooks(outgoing="head", reference=False))
        assert not session.wants_observations
        session.rollout_end(observations=torch.randn(100, 2))
        with session.phase("train"):
            model(torch.randn(8, 2))
        metrics = session.epoch_end(step=1)
    assert "probes/relu/body/dead_fraction" in metrics
    assert not [k for k in metrics if k.endswith("_ref") or "reference" in k]


def test_a_loop_without_rollout_end_reports_no_ref_key_and_says_so_once(tmp_path, caplog):
    torch.manual_seed(5)
    model = DenseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    caplog.set_level(logging.WARNING, logger="policy_probes")
    with session_for(model, tmp_path / "run") as session:
        session.add_training_hook("body", attach_relu_activation_hooks())
        session.add_training_hook("body", attach_utility_hooks(outgoing="head"))
        records = []
        for epoch in range(3):
            with session.phase("train"):
                opt.zero_grad()
                model(torch.randn(16, 2)).pow(2).mean().backward()
                opt.step()
            records.append(session.epoch_end(step=16 * (epoch + 1)))
        errors = dict(session.context.probe_errors)
    for metrics in records:
        assert "probes/relu/body/dead_fraction" in metrics  # training and probing go on
        assert "probes/utility/body.1/low_utility_fraction" in metrics
        assert not [k for k in metrics if k.endswith("_ref")]
        assert metrics["probes/errors/relu/reference_states"] == 1.0
        assert metrics["probes/errors/utility/reference_states"] == 1.0
    assert "session.rollout_end(observations=...)" in errors["relu/reference_states"]
    warned = [r for r in caplog.records if "no reference states" in r.getMessage()]
    assert len(warned) == 2  # once per probe, not per epoch


class DictPolicy(nn.Module):
    """A policy whose forward takes a dict (as RLlib's RLModule and TensorDict modules do),
    with a batch norm whose running statistics a forward in training mode moves."""

    def __init__(self) -> None:
        super().__init__()
        self.body = DenseNet().body
        self.norm = nn.BatchNorm1d(5)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.norm(self.body(batch["obs"]))


def test_a_model_whose_forward_takes_no_tensor_is_scored_through_the_forward_given(
    tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="policy_probes")
    torch.manual_seed(7)
    rollout = torch.rand(600, 2) * 2 - 1
    scored = []
    for give in (False, True):
        model = DictPolicy()
        forward = (lambda obs, m=model: m({"obs": obs})) if give else None
        session = ProbeSession(
            model,
            run=tmp_path / f"run{len(scored)}",
            probing=ProbeSettings(sinks=JSONL_ONLY, probe_budget=None),
            forward=forward,
        )
        session.add_training_hook("body", attach_relu_activation_hooks())
        session.rollout_end(observations=rollout)
        with session.phase("train"):
            model({"obs": torch.rand(32, 2)}).sum().backward()
        stats = model.norm.running_mean.clone(), model.norm.running_var.clone()
        scored.append(session.epoch_end(step=1))
        session.close()
        # the set's forward in training mode leaves the batch norm's statistics as they were
        assert torch.equal(model.norm.running_mean, stats[0])
        assert torch.equal(model.norm.running_var, stats[1])
    without, given = scored
    assert "probes/relu/body/dead_fraction_ref" not in without
    said = [r.getMessage() for r in caplog.records if "reference states alone" in r.getMessage()]
    assert len(said) == 1 and "ProbeSession(forward=...)" in said[0]
    with torch.no_grad():
        h = model.body(expected_rows(rollout))
    assert given["probes/relu/body/dead_fraction_ref"] == pytest.approx(dead_share(h))
    assert given["probes/relu/body/dormant_fraction_ref"] == pytest.approx(dormant_share(h))
    assert "probes/errors/relu/reference_states" not in given
    with pytest.raises(TypeError, match="forward must be callable"):
        ProbeSession(DictPolicy(), run=tmp_path / "bad", forward="model")  # type: ignore[arg-type]


# ----------------------------------------------------------------- training unchanged
def tiny_tool(run_dir: Path, reference: bool) -> TrainTool:
    tool = TrainTool(
        env=EnvConfig(id="CartPole-v1", num_envs=2),
        policy=PolicyConfig(hidden_sizes=[16, 16], activation="relu"),
        trainer=PPOConfig(total_timesteps=256, num_steps=32, num_minibatches=4, update_epochs=2),
        evaluation={"every_epochs": 0, "at_end": False},
        checkpoint={"every_epochs": 0},
        sinks={"console": False, "csv": False, "wandb": False, "tensorboard": False},
        wandb={"mode": "disabled"},
        torch_threads=1,
        seed=5,
        run_dir=str(run_dir),
    )
    for component in ("actor_mlp", "critic_mlp"):
        tool.add_training_hook(component, attach_relu_activation_hooks(reference=reference))
    tool.add_training_hook(
        "actor_mlp", attach_utility_hooks(outgoing="actor_head", reference=reference)
    )
    return tool


def test_measuring_on_the_set_leaves_training_bit_identical(tmp_path):
    on = tiny_tool(tmp_path / "on", reference=True).invoke()
    off = tiny_tool(tmp_path / "off", reference=False).invoke()
    a, b = on.policy.state_dict(), off.policy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with_ref = read_jsonl(tmp_path / "on" / "metrics.jsonl")
    without = read_jsonl(tmp_path / "off" / "metrics.jsonl")
    assert len(with_ref) == len(without) == 4
    for x, y in zip(with_ref, without, strict=True):
        added = {k for k in x if k not in y}
        assert added and all(k.endswith("_ref") for k in added)
        assert y.keys() <= x.keys()
        assert {k: v for k, v in y.items() if not k.startswith(WALL_CLOCK)} == {
            k: x[k] for k in y if not k.startswith(WALL_CLOCK)
        }


# ----------------------------------------------------------------- several processes
def rank_states(rank: int) -> torch.Tensor:
    """Each rank's reference states (different sizes, x0 of one sign per rank)."""
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.rand(30 + 20 * rank, 2, generator=g) * 2 - 1
    x[:, 0] = x[:, 0].abs() * (1 if rank else -1)
    return x


def ranked_model(states: torch.Tensor) -> tuple[DenseNet, ComponentContext]:
    """The model with relu and utility on ``body`` in a bare context given ``states``."""
    torch.manual_seed(6)
    model = DenseNet()
    ctx = ComponentContext()
    ctx.reference_states = ReferenceStates()
    ctx.reference_states.fix(states)
    ctx.reference_states.forward = model
    policy = PolicyAutoBuilder.wrap(model)
    policy.attach("body", attach_relu_activation_hooks(), ctx)
    policy.attach("body", attach_utility_hooks(outgoing="head"), ctx)
    model(torch.rand(8, 2) - 0.5)  # a training pass (the context's phase is "train")
    return model, ctx


def rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        _, ctx = ranked_model(rank_states(rank))
        metrics = StatsReporter(ctx).collect()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


def test_scores_of_several_processes_are_those_of_the_union_of_their_sets(tmp_path):
    mp.spawn(rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    union = torch.cat([rank_states(0), rank_states(1)])
    model, _ = ranked_model(union)
    with torch.no_grad():
        h1, h3 = model.body[:2](union), model.body(union)
    for name, h in (("body.1", h1), ("body.3", h3), ("body", h3)):
        for metrics in (r0, r1):
            assert metrics[f"probes/relu/{name}/dead_fraction_ref"] == pytest.approx(dead_share(h))
            assert metrics[f"probes/relu/{name}/dormant_fraction_ref"] == pytest.approx(
                dormant_share(h)
            )
    assert r0["probes/relu/body.1/dead_fraction_ref"] == 0.25  # unit 0 lives on rank 1's
    out_sum = model.body[2].weight.detach().abs().sum(0)
    assert r0["probes/utility/body.1/low_utility_fraction_ref"] == pytest.approx(
        low_utility_share(h1, out_sum)
    )


def test_non_finite_values_on_the_set_are_left_out_per_unit():
    from policy_probes.probes.reference_scores import UnitValues

    h = torch.tensor(
        [[[1.0, -2.0], [float("nan"), 0.0]], [[float("inf"), 3.0], [0.5, -0.5]]]
    )  # (B=2, C=2, L=2), channels first
    values = UnitValues.of(h, channels_first=True)
    per_channel = h.transpose(0, 1).reshape(2, -1).double()  # channel c: its 4 values
    finite = per_channel.isfinite()
    clean = torch.where(finite, per_channel, 0.0)
    assert values.count().tolist() == finite.sum(1).tolist() == [3, 3]
    assert values.positive().tolist() == (clean > 0).sum(1).tolist() == [2, 1]
    assert values.abs_sum().tolist() == clean.abs().sum(1).tolist() == [6.0, 1.0]
    dense = UnitValues.of(torch.tensor([[1.0, -1.0], [0.0, 2.0]]), channels_first=False)
    assert dense.count().tolist() == [2, 2] and dense.positive().tolist() == [1, 1]
    assert dense.abs_sum().tolist() == [1.0, 3.0]
