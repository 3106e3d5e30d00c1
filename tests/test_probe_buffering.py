"""Row buffering changes nothing but speed: the same metrics (to float32 rounding of the
Fisher matmul) with a buffer that flushes mid-window (and one too small for a whole
minibatch), and memory that does not grow with the number of steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy, attach_all_probes

from policy_probes import (
    ComponentContext,
    StatsReporter,
)


def probed(buffer_elements: int | None) -> tuple[TinyPolicy, ComponentContext]:
    torch.manual_seed(0)
    policy = TinyPolicy()
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="sigmoid")
    if buffer_elements is not None:
        for tracker in ctx.model_metrics.values():
            tracker.buffer_elements = buffer_elements
    return policy, ctx


def train(policy: TinyPolicy, ctx: ComponentContext, sizes: tuple[int, ...]) -> dict:
    g = torch.Generator().manual_seed(1)
    for n in sizes:
        x, a = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
        F.cross_entropy(policy(x), a).backward()
    return StatsReporter(ctx).collect()


@pytest.mark.parametrize("buffer_elements", [60, 300])
def test_mid_window_flushes_give_identical_metrics(buffer_elements: int) -> None:
    sizes = (12, 5, 30, 7, 7, 19)
    reference = train(*probed(None), sizes)  # the default buffer holds the whole window
    small = train(*probed(buffer_elements), sizes)  # flushes often; 30 rows never fit at 60
    assert small.keys() == reference.keys()
    for key, value in reference.items():
        assert small[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (
            key
        )  # float32 matmul partial sums


def test_tracker_memory_does_not_grow_with_steps() -> None:
    policy, ctx = probed(2_000)
    train(policy, ctx, (16,) * 5)
    after_few = sum(t.nbytes() for t in ctx.model_metrics.values())
    train(policy, ctx, (16,) * 300)
    after_many = sum(t.nbytes() for t in ctx.model_metrics.values())
    assert after_few == after_many > 0
