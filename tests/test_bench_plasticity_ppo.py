"""The verdict of the forked-arms test in benchmarks.plasticity_ppo, fixed before the
runs: higher than the none child in the mean and for all but at most one seed."""

from __future__ import annotations

from benchmarks.plasticity_ppo import verdict


def test_verdict_criterion():
    assert verdict([5.0, 1.0, 2.0, -3.0, 4.0]) == "recovers"  # mean > 0, 4 of 5 up
    assert verdict([5.0, 1.0, -2.0, -3.0, 4.0]) == "unclear"  # 3 of 5
    assert verdict([-50.0, 1.0, 2.0, 3.0, 4.0]) == "unclear"  # 4 of 5 up, mean < 0
    assert verdict([-5.0, -1.0, -2.0, -3.0, 4.0]) == "lowers"
    assert verdict([0.0, 0.0, 0.0, 0.0, 0.0]) == "unclear"
