"""Smoke run of benchmarks/sb3_recurrent_overhead.py (in process): both sides run
RecurrentPPO, the callback side reports its probes, and the JSON holds the ratio."""

from __future__ import annotations

import json

from benchmarks import ab, sb3_recurrent_overhead


def test_sb3_recurrent_overhead_quick_writes_a_positive_ratio(tmp_path):
    out = tmp_path / "sb3_recurrent.json"
    try:
        sb3_recurrent_overhead.main(["--quick", "--inprocess", "--out", str(out)])
    finally:
        ab.IN_PROCESS = False
    result = json.loads(out.read_text())
    (comp,) = result["comparisons"]
    assert comp["a"]["params"]["recurrent"] is comp["b"]["params"]["recurrent"] is True
    assert len(comp["ratios_b_over_a"]) == 1 and comp["median_ratio_b_over_a"] > 0
    (b,) = comp["extra_b"]
    assert b["records"] == 1  # 512 steps = one rollout/update cycle of 4 envs x 128 steps
    # per MLP (2 hidden ReLU layers, each also reported per layer): relu 8 x 3 +
    # saturation 6 (no tanh layer) + fisher 12 (unit, nonfinite_fraction, samples, 4
    # parameter traces, trace, mean, max, dead_param_fraction, unsupported_params) +
    # gradient_flow 6 x 3 + relu_gradient_flow 4 x 3; per LSTM (no activation layer
    # inside, so no per-layer keys): relu 8 + saturation 6 + fisher 12 (its 4 weights
    # on the gate-gradient rule, as for an MLP) + gradient_flow 6
    # Sampling keys on top: relu's 2 standard errors per relu name (3 per MLP, 1 per
    # LSTM), saturation's 1 per saturation name (1 each), passes_observed and
    # rows_observed per probe and component (5 per MLP, 4 per LSTM), the two
    # probes/overhead_* keys and the overhead's parts (passes.<probe> of the 5 probes,
    # report, arming, sampler, records).
    values = 2 * (8 * 3 + 6 + 12 + 6 * 3 + 4 * 3) + 2 * (8 + 6 + 12 + 6)
    sampling = 2 * 2 * (3 + 1) + (2 + 2) + 2 * 2 * (5 + 4) + 2 + (5 + 4)
    # Plasticity keys: dormant_fraction_tau_{0, 0.025, 0.1} per relu name (3 per MLP, 1
    # per LSTM); the gradient noise scale (grad_sq_norm, grad_var_trace,
    # grad_noise_scale) per nn.Linear parameter (2 layers x weight and bias per MLP) and
    # per component (MLPs only: the LSTM's rule has none)
    plasticity = 3 * (2 * 3 + 2 * 1) + 2 * 3 * (4 + 1)
    assert b["probe_keys"] == values + sampling + plasticity
    assert "records" not in comp["extra_a"][0]
