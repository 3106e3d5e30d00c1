"""Acceptance: lifecycle hooks never change the training trajectory."""

from __future__ import annotations

import numpy as np
import torch
from lifecycle_support import RunResult, run_training

from policy_probes.lifecycle import HookRegistry, select_hooks


def assert_same_trajectory(a: RunResult, b: RunResult) -> None:
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), f"parameter {name} differs"
    for idx, st in a.optimizer_state["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b.optimizer_state["state"][idx][key]), (
                f"optimizer state {idx}/{key}"
            )
    assert torch.equal(a.rng_after[0], b.rng_after[0])
    assert np.array_equal(a.rng_after[1], b.rng_after[1])
    assert a.rng_after[2] == b.rng_after[2]
    # on CUDA the rollout samples its actions from the CUDA generator, which the hooks
    # draw from too (random start vectors, sampled actions, the debug hook's reseeding)
    assert len(a.rng_after[3]) == len(b.rng_after[3])
    assert all(torch.equal(x, y) for x, y in zip(a.rng_after[3], b.rng_after[3], strict=True))


def test_observers_and_probes_leave_parameters_bit_identical(device: torch.device) -> None:
    baseline = run_training(device=device)
    observed = run_training(select_hooks(with_hooks="observers"), probes=True, device=device)
    assert_same_trajectory(baseline, observed)
    # the observers did run and reported, and nothing failed
    assert observed.manager.errors == {}
    last = observed.metrics[-1]
    for key in (
        "norms/grad_norm",
        "norms/update_ratio",
        "adam_dynamics/step_rms",
        "feature_rank/actor_mlp/effective_rank",
        "probes/relu/actor_mlp/dead_fraction",
        "probes/fisher/critic_mlp/trace",
        "train/loss",
        "train/learning_rate",
    ):
        assert key in last, key


def test_all_interventions_including_the_corrupting_debug_hook_leave_parameters_bit_identical(
    device: torch.device,
) -> None:
    hooks = select_hooks(with_hooks="with_debug")
    assert {h.name for h in hooks} >= {
        "hessian",
        "policy_fisher",
        "counterfactual",
        "debug_corrupt",
    }
    baseline = run_training(device=device)
    intervened = run_training(hooks, probes=True, device=device)
    assert_same_trajectory(baseline, intervened)
    errors = intervened.manager.errors
    # only the debug hook failed: at every firing of every point it fired at
    assert set(errors) == {"debug_corrupt"}
    assert errors["debug_corrupt"] > 20
    snapshot = intervened.metrics[1]
    assert "hessian/top_eigenvalue" in snapshot
    assert "counterfactual/param_distance" in intervened.metrics[0]
    assert "policy_fisher/trace" in intervened.metrics[0]
    assert intervened.metrics[0]["debug_corrupt/error"] == 1.0


def test_module_probes_do_not_record_the_passes_interventions_make(device: torch.device) -> None:
    observers = select_hooks([])
    interventions = select_hooks(HookRegistry.expand("interventions"))
    a = run_training(observers, probes=True, device=device)
    b = run_training(interventions, probes=True, device=device)
    probe_keys = [k for k in a.metrics[-1] if k.startswith("probes/")]
    assert probe_keys
    for epoch_a, epoch_b in zip(a.metrics, b.metrics, strict=True):
        for key in probe_keys:
            assert epoch_a[key] == epoch_b[key], key
