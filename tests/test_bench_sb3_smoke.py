"""Smoke run of benchmarks/sb3_overhead.py: it runs both sides and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sb3_overhead.py"


def test_sb3_overhead_quick_writes_a_positive_ratio(tmp_path):
    out = tmp_path / "sb3.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "sb3_overhead"
    assert result["repeats"] == 1 and len(result["ratios_b_over_a"]) == 1
    assert result["median_ratio"] > 0
    assert result["median_ratio"] == result["ratios_b_over_a"][0]
    assert set(result["median_seconds"]) == {"A", "B"}
    assert all(v > 0 for v in result["median_seconds"].values())
    assert result["hyperparameters"]["num_envs"] == 4
    assert result["records_per_run"] == 1024 // (4 * 128)  # one record per update cycle
    assert result["probe_keys_per_record"] > 0
    assert "machine" in result and result["machine"]["torch"]
