"""Remedies through the built-in trainer (TrainTool): switched on by the ``remedies``
field and by ``add_remedy``, logged into the epoch's records, and a run stopped after a
firing and resumed from its checkpoint ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from run_control_support import StopAfter

from policy_probes.cli import apply_overrides
from policy_probes.plugins import from_spec
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.remedies import shrink_and_perturb
from trainers import EnvConfig, PolicyConfig, PPOConfig, TrainTool

torch.set_num_threads(1)
EPOCHS = 4


def tool(run_dir, device: torch.device = torch.device("cpu")) -> TrainTool:
    """The tiny PPO run with its remedies, its policy on ``device``."""
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
        device=device.type,
        seed=5,
        probe_budget=None,  # every pass: resumed and plain runs observe the same passes
        run_dir=run_dir,
    )
    t.add_training_hook("critic_mlp", attach_relu_activation_hooks())
    t.add_remedy("actor_mlp", shrink_and_perturb(shrink=0.9, noise=0.05, every_epochs=2))
    # the command-line shape: a JSON list of specs
    return apply_overrides(t, ['remedies=["redo@critic_mlp:tau=0.3,every_epochs=2"]'])


def records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("point", "POST_EPOCH") == "POST_EPOCH"]


@pytest.mark.parametrize("stop_at", [2, 3])
def test_resume_across_a_firing_is_bit_identical(tmp_path, stop_at, device: torch.device):
    plain = tool(tmp_path / "plain", device).invoke()
    rows = {
        r["epoch"]: r for r in records(tmp_path / "plain") if "remedies/redo/critic_mlp/fired" in r
    }
    assert [rows[e]["remedies/redo/critic_mlp/fired"] for e in range(1, EPOCHS + 1)] == [0, 1, 0, 1]
    assert rows[4]["remedies/redo/critic_mlp/units_reset"] > 0  # the firing after the resume acts
    assert rows[4]["remedies/shrink_and_perturb/actor_mlp/fired"] == 1
    assert rows[2]["remedies/redo/critic_mlp/units_reset"] == (
        rows[2]["remedies/redo/critic_mlp.layer_0/units_reset"]
        + rows[2]["remedies/redo/critic_mlp.layer_1/units_reset"]
    )

    stopped = tool(tmp_path / "resumed", device).add_trainer_hook(StopAfter(stop_at)).invoke()
    assert stopped.epochs == stop_at
    resumed = tool(tmp_path / "resumed", device).invoke(resume=True)
    assert resumed.epochs == EPOCHS
    a, b = plain.policy.state_dict(), resumed.policy.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_remedies_field_accepts_specs_and_refuses_bad_ones(tmp_path):
    t = tool(tmp_path / "x")
    t = apply_overrides(
        t,
        [
            "remedies=redo@critic_mlp:tau=0.1,every_epochs=3;reset_layers@actor_head:last=1,every_epochs=5"
        ],
    )
    added = [p for p, _ in t._remedies]  # the recipe's, then the configuration's
    configured = [from_spec(spec, "remedy")[0] for spec in t.remedies]
    assert added + configured == ["actor_mlp", "critic_mlp", "actor_head"]
    with pytest.raises(Exception, match=r"unknown remedy 'redox'. Did you mean 'redo'\?"):
        apply_overrides(t, ["remedies=redox@critic_mlp:every_epochs=1"])
    with pytest.raises(ValueError, match="tau must be >= 0"):
        TrainTool(remedies=["redo@critic_mlp:tau=-1,every_epochs=1"])


def test_dry_run_checks_the_remedies(tmp_path):
    t = tool(tmp_path / "dry")
    t.check_setup()  # the probes and remedies of the tool fit its policy
    bad = apply_overrides(t, ["remedies=redo@actor_mlp:every_epochs=2"])
    with pytest.raises(ValueError, match="attach_relu_activation_hooks\\(\\) to 'actor_mlp'"):
        bad.check_setup()
    unknown = apply_overrides(t, ["remedies=reset_layers@critic:last=1,every_epochs=2"])
    with pytest.raises(KeyError, match="critic"):
        unknown.check_setup()
