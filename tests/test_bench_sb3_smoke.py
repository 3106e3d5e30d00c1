"""Smoke run of benchmarks/sb3_overhead.py: both sides run and the JSON holds the ratio."""

from __future__ import annotations

import json

from benchmarks import sb3_overhead


def test_sb3_overhead_quick_writes_a_positive_ratio(tmp_path):
    out = tmp_path / "sb3.json"
    sb3_overhead.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    (comp,) = result["comparisons"]
    assert comp["a"]["case"] == comp["b"]["case"] == "sb3"
    assert comp["b"]["params"]["probe_callback"] is True
    assert len(comp["ratios_b_over_a"]) == 1 and comp["median_ratio_b_over_a"] > 0
    (b,) = comp["extra_b"]
    assert b["records"] == 1024 // (4 * 128)  # one record per rollout/update cycle
    assert b["probe_keys"] > 0
    assert "records" not in comp["extra_a"][0]
    assert result["machine"]["torch"]
