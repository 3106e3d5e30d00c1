"""The per-step remedies and plasticity injection through the built-in trainer: the same
seed gives the same firings, another remedy seed others, and a run killed with SIGKILL
and resumed from its checkpoint ends with the parameters and the remedy records of an
uninterrupted run (the checkpoint carries CBP's utilities and ages, L2 Init's anchors and
the injected copy with its optimizer)."""

from __future__ import annotations

import json
import signal

import torch
from run_control_support import (
    assert_each_epoch_once,
    assert_same_params,
    baseline_params,
    final_params,
    kill,
    start_run,
    wait_for_epoch,
    write_recipe,
)

from policy_probes.cli import main

SPECS = [
    "continual_backprop@critic_mlp:replacement_rate=0.05,maturity_threshold=8,decay=0.9",
    "l2_init@actor_head:coef=0.05",
    "soft_shrink_perturb@critic_head:shrink=0.995,noise=0.005",
    "plasticity_injection@actor_mlp:every_epochs=1",
]


def remedies(specs: list[str]) -> str:
    return f"remedies={json.dumps(specs)}"


def remedy_rows(run_dir) -> dict[int, dict[str, float]]:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["hook_point"] == "POST_EPOCH":
            rows[r["epoch"]] = {k: v for k, v in r.items() if k.startswith("remedies/")}
    return rows


def on_cpu(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies (a checkpoint is loaded onto the CPU, a run's policy is on its device)."""
    return {k: v.cpu() for k, v in params.items()}


def test_same_seed_same_firings_and_sigkill_resume_reproduces_them(tmp_path, device: torch.device):
    target = write_recipe(tmp_path)
    on_device = f"device={device.type}"  # the recipe's policy on the test's device
    override = remedies(SPECS)
    plain = baseline_params(target, tmp_path / "plain", override, on_device)
    again = baseline_params(target, tmp_path / "again", override, on_device)
    other_specs = [SPECS[0] + ",seed=123", *SPECS[1:]]
    other = baseline_params(target, tmp_path / "other", remedies(other_specs), on_device)
    rows = remedy_rows(tmp_path / "plain")
    assert_same_params(plain, again)
    assert remedy_rows(tmp_path / "again") == rows
    cbp = "remedies/continual_backprop/critic_mlp/units_reset"
    resets = [rows[e][cbp] for e in sorted(rows)]
    assert sum(resets) > 0 and resets[0] == 0  # none before the units mature (8 steps an epoch)
    assert any(not torch.equal(plain[k], other[k]) for k in plain)  # other fresh weights
    assert [rows[e]["remedies/plasticity_injection/actor_mlp/fired"] for e in sorted(rows)] == [
        1.0,
        *[0.0] * (len(rows) - 1),
    ]
    assert all(rows[e]["remedies/l2_init/actor_head/steps"] == 8.0 for e in rows)

    run_dir = tmp_path / "killed"
    proc = start_run(target, run_dir, override, on_device)
    wait_for_epoch(run_dir, 3, proc)
    assert kill(proc) == -signal.SIGKILL
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    assert_each_epoch_once(run_dir)
    assert_same_params(final_params(run_dir), on_cpu(plain))
    assert remedy_rows(run_dir) == rows
