"""The labelled findings benchmark's own measurements and scoring
(``benchmarks/findings_bench.py``), on tiny inputs computed by hand."""

from __future__ import annotations

import math

import numpy as np
import torch

from benchmarks import findings_bench as fb
from benchmarks.injections import KillUnits, LrJump
from trainers.callbacks import TrainerState


def test_dead_fraction_of_known_weights() -> None:
    """Layer 0: unit 0 passes x0 (alive on x0 > 0), unit 1 has zero weights and bias -1,
    unit 2 reads -x0 - 5 (< 0 on every state here): 2 of 3 dead. Layer 1: unit a copies
    unit 0 (alive), unit b reads -h1 = 0 (dead): 3 of 5 hidden units dead in all."""
    w0 = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    b0 = torch.tensor([0.0, -1.0, -5.0])
    w1 = torch.tensor([[1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
    b1 = torch.zeros(2)
    states = np.array([[1.0, 0.0], [2.0, 1.0], [-1.0, 3.0]], dtype=np.float32)
    assert fb.dead_fraction([w0, b0], states) == 2 / 3
    assert fb.dead_fraction([w0, b0, w1, b1], states) == 3 / 5


def test_hidden_layers_reads_the_state_dict_in_order() -> None:
    sd = {
        "actor_mlp.layer_1.linear.weight": torch.ones(2, 3),
        "actor_mlp.layer_1.linear.bias": torch.ones(2),
        "actor_mlp.layer_0.linear.weight": torch.zeros(3, 4),
        "actor_mlp.layer_0.linear.bias": torch.zeros(3),
        "critic_mlp.layer_0.linear.weight": torch.zeros(5, 4),
    }
    shapes = [tuple(p.shape) for p in fb.hidden_layers(sd, "actor_mlp")]
    assert shapes == [(3, 4), (3,), (2, 3), (2,)]


def test_trainability_of_dead_units_is_worse_than_fresh() -> None:
    """All hidden units dead: only the head's bias learns, so the best loss is the
    standardised targets' biased variance, (n - 1) / n per output; a fresh network fits
    better, so the ratio is above 1."""
    n = 128
    states = np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32)
    dead = [
        torch.zeros(16, 4),
        torch.full((16,), -10.0),
        torch.zeros(16, 16),
        torch.full((16,), -10.0),
    ]
    out = fb.trainability(dead, states, seed=3, steps=60, targets=2, fresh=1)
    assert math.isclose(out["loss"], (n - 1) / n, abs_tol=2e-3)
    assert out["fresh_loss"] < out["loss"]
    assert out["ratio"] == out["loss"] / out["fresh_loss"] > 1.0


def _run(pathology: str, seed: int, ret: list[float], **extra: object) -> dict:
    return {
        "setting": "s",
        "pathology": pathology,
        "seed": seed,
        "random_return": 20.0,
        "return": ret,
        "return_std": [1.0] * len(ret),
        **extra,
    }


def test_labels_harm_decline_and_target_scale() -> None:
    """Healthy return 100, random 20; the pathological run's falls to 30 from epoch 60.
    Final: 30 - 20 = 10 < 0.8 x 80, harmed. Decline: the 10-epoch mean minus 20 falls
    below 64 once k >= 3 of its epochs are at 30 ((100 (10 - k) + 30 k) / 10 < 84), at
    epoch 62. GAE-return std 5 against 1: grew (>= 4)."""
    healthy = _run("healthy", 1, [100.0] * 100)
    sick = _run("p", 1, [100.0] * 59 + [30.0] * 41)
    sick["return_std"] = [5.0] * 100
    fb.label_runs([healthy, sick], inject=50)
    lab = sick["labels"]
    assert lab["harms_learning"] is True
    assert lab["decline_epoch"] == 62
    assert math.isclose(lab["return_vs_healthy"], 10 / 80)
    assert lab["value_target_scale_grew"] is True
    assert healthy["labels"]["harms_learning"] is False
    assert healthy["labels"]["decline_epoch"] is None
    # a healthy run that never beat random (20) labels no harm
    stuck = _run("healthy", 2, [20.0] * 100)
    other = _run("p", 2, [20.0] * 100)
    fb.label_runs([stuck, other], inject=50)
    assert other["labels"]["harms_learning"] is None
    assert other["labels"]["decline_epoch"] is None


def test_labels_plasticity_lost_needs_ratio_above_every_healthy_run() -> None:
    ret = [100.0] * 100
    runs = [
        _run("healthy", 1, ret, ratio_actor_end=1.2, ratio_critic_end=1.0),
        _run("healthy", 2, ret, ratio_actor_end=1.8, ratio_critic_end=1.0),
        _run("p", 1, ret, ratio_actor_end=1.7, ratio_critic_end=1.6),
        _run("p", 2, ret, ratio_actor_end=1.9, ratio_critic_end=1.4),
    ]
    fb.label_runs(runs, inject=50)
    assert runs[2]["labels"]["plasticity_lost"] == ["critic"]  # actor 1.7 < healthy 1.8
    assert runs[3]["labels"]["plasticity_lost"] == ["actor"]  # critic 1.4 < 1.5
    assert runs[1]["labels"]["plasticity_lost"] == ["actor"]  # a healthy run: >= 1.5 alone


def _finding(rule: str, tier: str, onset: int, first: int) -> dict:
    return dict(
        rule=rule, tier=tier, component="c", onset_epoch=onset, last_epoch=100, first_epoch=first
    )


def test_score_counts_on_constructed_findings() -> None:
    """Two healthy runs (one flagged by A), two harmed runs of p: one carries A (onset 52,
    first shown 55, decline 60), the other the observation B (onset 40, no decline)."""
    lab = {"harms_learning": True}
    runs = [
        {"pathology": "healthy", "findings": [_finding("A", "finding", 20, 30)]},
        {"pathology": "healthy", "findings": []},
        {
            "pathology": "p",
            "labels": {**lab, "decline_epoch": 60},
            "findings": [_finding("A", "finding", 52, 55)],
        },
        {
            "pathology": "p",
            "labels": {**lab, "decline_epoch": None},
            "findings": [_finding("B", "observation", 40, 45)],
        },
    ]
    s = fb.score(runs, inject=50)
    a, b = s["rules"]["A/finding"], s["rules"]["B/observation"]
    assert (a["healthy_flagged"], a["healthy_runs"], a["recall"]["p"]) == (1, 2, [1, 2])
    assert (a["onset_delays"], a["leads"], a["harmed_from_injection"]) == ([2], [5], [1, 2])
    assert b["harmed_from_injection"] == [0, 2]
    assert (b["healthy_flagged"], b["recall"]["p"], b["onset_delays"], b["leads"]) == (
        0,
        [1, 2],
        [-10],
        [],
    )
    assert s["tiers"]["finding"]["healthy_with_any"] == 1
    assert s["tiers"]["finding"]["pathologies"]["p"] == {
        "seeds": 2,
        "harmed": 2,
        "with_finding_after_injection": 1,
    }
    assert s["tiers"]["observation"]["healthy_with_any"] == 0
    assert s["tiers"]["observation"]["pathologies"]["p"]["with_finding_after_injection"] == 0


def _state(policy: torch.nn.Module, lr: float = 0.1, epochs: int = 10) -> TrainerState:
    from policy_probes.context import ComponentContext

    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda done: 1.0 - done / epochs)
    return TrainerState(
        trainer=None,
        policy=policy,
        optimizer=opt,
        scheduler=sched,
        context=ComponentContext(),
        config={},
    )


def _mlp(sizes: list[int]) -> torch.nn.Module:
    layers = torch.nn.Module()
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layer = torch.nn.Module()
        layer.linear = torch.nn.Linear(a, b)
        layers.add_module(f"layer_{i}", layer)
    return layers


def test_kill_units_leaves_the_fraction_dead_on_any_input() -> None:
    """75 % of 8 units = 6 per layer: incoming weights 0, bias -10, so their output is 0
    on every state whatever the other units do."""
    torch.manual_seed(0)
    policy = torch.nn.Module()
    policy.actor_mlp, policy.critic_mlp = _mlp([3, 8, 8]), _mlp([3, 8, 8])
    KillUnits(epoch=1, seed=5).inject(_state(policy))
    states = np.random.default_rng(1).normal(size=(64, 3)).astype(np.float32)
    for mlp in ("actor_mlp", "critic_mlp"):
        params = fb.hidden_layers(dict(policy.state_dict()), mlp)
        assert fb.dead_fraction(params, states) >= 12 / 16
        for w in params[::2]:
            assert int((w.abs().sum(1) == 0).sum()) == 6


def test_lr_jump_stays_raised_under_annealing() -> None:
    """lr 0.1 annealed over 10 epochs (epoch i trains with 0.1 (1 - (i - 1) / 10)); x30
    from epoch 3: 3.0 x (1 - 2/10) = 2.4, then 3.0 x 0.7 = 2.1 after one more step."""
    state = _state(torch.nn.Linear(2, 1))
    state.optimizer.step()  # no gradients: a no-op, in the order torch expects
    state.scheduler.step()
    state.scheduler.step()  # epoch 3's rate: 0.08
    LrJump(epoch=3, seed=1, factor=30.0).inject(state)
    assert math.isclose(state.optimizer.param_groups[0]["lr"], 2.4)
    state.scheduler.step()
    assert math.isclose(state.optimizer.param_groups[0]["lr"], 2.1)


def test_train_measured_reports_every_plasticity_probe(tmp_path) -> None:
    """Two epochs of the benchmark's recipe: the four probes of ``train`` and weights,
    preactivation, utility on both MLPs, churn on both heads; no evaluation."""
    from recipes import cartpole

    tool = cartpole.train_measured()
    assert tool.probe_budget is None and tool.evaluation.every_epochs == 0
    tool.run_dir = tmp_path / "run"
    tool.trainer = tool.trainer.model_copy(update={"total_timesteps": 1024})
    tool.wandb.mode, tool.sinks.console = "disabled", False
    m = tool.invoke().metrics
    for comp in ("actor_mlp", "critic_mlp"):
        for probe in ("relu", "fisher", "gradient_flow", "weights", "utility"):
            assert any(k.startswith(f"probes/{probe}/{comp}") for k in m), (probe, comp)
        assert any(k.startswith(f"probes/preactivation/{comp}") for k in m), comp
    assert "probes/churn/actor_head/policy_kl" in m
    assert "probes/churn/critic_head/value_change" in m
