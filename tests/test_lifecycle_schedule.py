"""StepSchedule, epoch windows and loop_points resolution."""

from __future__ import annotations

import pytest

from policy_probes.lifecycle import EpochWindow, HookPoint, StepSchedule, TrainingHook, snapshot_due
from policy_probes.lifecycle.points import resolve_points


def due_set(schedule: StepSchedule, n: int = 40) -> set[int]:
    return {i for i in range(n) if schedule.due(i)}


def test_continual_fires_every_step_after_warmup() -> None:
    assert due_set(StepSchedule.continual()) == set(range(40))
    assert due_set(StepSchedule.continual(warmup=7)) == set(range(7, 40))


def test_stride_fires_every_nth_step_from_warmup() -> None:
    assert due_set(StepSchedule.stride(4)) == set(range(0, 40, 4))
    assert due_set(StepSchedule.stride(3, warmup=5)) == set(range(5, 40, 3))


def test_burst_fires_k_consecutive_steps_every_n() -> None:
    expected = {b + k for b in range(0, 40, 10) for k in range(3)}
    assert due_set(StepSchedule.burst(3, 10)) == expected
    shifted = {b + k for b in range(6, 40, 10) for k in range(2) if b + k < 40}
    assert due_set(StepSchedule.burst(2, 10, warmup=6)) == shifted


def test_parse_round_trips_and_rejects_bad_specs() -> None:
    assert StepSchedule.parse("continual") == StepSchedule.continual()
    assert StepSchedule.parse("stride:4") == StepSchedule.stride(4)
    assert StepSchedule.parse("burst:2/10,warmup:100") == StepSchedule.burst(2, 10, warmup=100)
    for s in (StepSchedule.stride(5, 3), StepSchedule.burst(1, 4), StepSchedule.continual(2)):
        assert StepSchedule.parse(str(s)) == s
    for bad in ("", "every:3", "stride", "stride:x", "burst:5/2", "stride:0", "stride:2,warm:3"):
        with pytest.raises(ValueError, match="schedule|burst"):
            StepSchedule.parse(bad)


def test_epoch_window_contains_and_intersects() -> None:
    w = EpochWindow(2, 5)
    assert [e for e in range(8) if w.contains(e)] == [2, 3, 4, 5]
    assert EpochWindow(None, 1).intersect(EpochWindow(0, None)) == EpochWindow(0, 1)
    with pytest.raises(ValueError, match="empty"):
        EpochWindow(3, 2)


def test_loop_points_select_points_and_windows_per_loop_type() -> None:
    spec = {"ppo": {"post_epoch": (10, None), HookPoint.SNAPSHOT: None}, "external": ["POST_EPOCH"]}
    assert resolve_points("ppo", [HookPoint.PRE_STEP], spec) == {
        HookPoint.POST_EPOCH: EpochWindow(10, None),
        HookPoint.SNAPSHOT: EpochWindow(),
    }
    assert resolve_points("external", [], spec) == {HookPoint.POST_EPOCH: EpochWindow()}
    assert resolve_points("other", [HookPoint.PRE_STEP], spec) == {}
    assert resolve_points("other", [HookPoint.PRE_STEP], None) == {
        HookPoint.PRE_STEP: EpochWindow()
    }
    with pytest.raises(
        ValueError, match="unknown hook point 'post_epohc'.*Did you mean POST_EPOCH"
    ):
        HookPoint.parse("post_epohc")


def test_hook_config_window_and_schedules_override_class_declarations() -> None:
    class Probe(TrainingHook):
        name = "probe"
        hook_points = (HookPoint.PRE_STEP, HookPoint.POST_EPOCH)
        step_schedule = StepSchedule.stride(2)

    default = Probe()
    assert [s for s in range(6) if default.is_due(HookPoint.PRE_STEP, 0, s)] == [0, 2, 4]
    tuned = Probe(schedule="burst:2/3", epochs="stride:2", min_epoch=1, max_epoch=4)
    points = tuned.points("ppo")
    assert points == {
        HookPoint.PRE_STEP: EpochWindow(1, 4),
        HookPoint.POST_EPOCH: EpochWindow(1, 4),
    }
    win = points[HookPoint.POST_EPOCH]
    assert [e for e in range(8) if tuned.is_due(HookPoint.POST_EPOCH, e, None, win)] == [2, 4]
    assert [s for s in range(6) if tuned.is_due(HookPoint.PRE_STEP, 1, s, win)] == [0, 1, 3, 4]
    assert not tuned.is_due(HookPoint.PRE_STEP, 0, 0, win)


def test_snapshot_due_every_n_epochs() -> None:
    assert [e for e in range(10) if snapshot_due(e, 3)] == [2, 5, 8]
    assert not any(snapshot_due(e, 0) for e in range(10))
