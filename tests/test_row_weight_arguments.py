"""Row-mask rows and the loss scale reach a probe as arguments (``weight``, ``loss_scale``).

* A custom probe whose ``record(obs, module, output, weight)`` passes ``weight`` on to
  ``_push`` gives the per-unit mean over the kept rows of a time-major ``nn.LSTM`` output
  under a ``(batch, time)`` mask with batch == time, where only the rows the observation
  bound (it knows the module) put the mask in the output's row order.
* A custom backward probe's ``record_grad(..., loss_scale)`` gets the
  ``context.loss_scale`` the loop set before each backward (after the forward), and
  ``grad * rows / loss_scale`` is the per-sample gradient of a hand-written loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from policy_probes import ComponentContext, PolicyAutoBuilder, Probe, StatsReporter
from policy_probes.probes.state import COUNT, as_rows, rates
from policy_probes.probes.weighted import Weighted

T = B = 4  # batch == time: the shapes cannot tell a time-major output from a batch-major one


class Mean(Probe):
    """The per-unit mean of the rows it is shown, over the rows the row mask keeps."""

    name = "mean"

    def update(self, component: str, h: torch.Tensor, weight: torch.Tensor | None) -> None:
        self._push(component, "h", (as_rows(h),), weight=weight)

    def record(self, obs, module: nn.Module, output: torch.Tensor, weight) -> None:
        self.update(obs.component, output, weight)

    def consume(self, batch) -> None:
        (h,) = batch.cols
        kept = Weighted(h, batch.weight)
        self._add(batch.component, "sum", kept.sums(h.clean).double())
        self._add(batch.component, "count", kept.finite_count(), COUNT)

    def summarize(self, component, s, settings) -> dict:
        return {"mean": rates(s["sum"], s["count"]).tolist(), "rows": float(s["count"].max())}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core = nn.LSTM(3, 5)  # time-major: (T, B, features)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.core(x)
        return self.head(out)


def test_a_custom_probe_gets_the_rows_its_hook_bound() -> None:
    torch.manual_seed(0)
    net = Net()
    policy = PolicyAutoBuilder.wrap(net, {"core": "core"})
    ctx = ComponentContext()
    policy.attach("core", Mean(), ctx)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert not torch.equal(mask, mask.T)
    x = torch.randn(T, B, 3)
    ctx.row_mask = mask
    with torch.no_grad():
        policy(x)
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    assert not ctx.probe_errors

    with torch.no_grad():
        out, _ = net.core(x)  # (T, B, H): row (t, b) is kept when mask[b, t] is
    kept = out[mask.T.bool()].double()
    assert got["probes/mean/core/rows"] == int(mask.sum())
    assert got["probes/mean/core/mean"] == pytest.approx(kept.mean(0).tolist(), rel=1e-6)


class PerSampleGrad(Mean):
    """Sums (rows / loss_scale * g)^2 per unit: the squared per-sample gradients."""

    name = "per_sample"
    direction = "backward"

    def __init__(self) -> None:
        super().__init__()
        self.scales: list[float] = []

    def record_grad(self, obs, module, grad_output, weight, loss_scale) -> None:
        g = as_rows(grad_output) * (grad_output.shape[0] / loss_scale)
        self.scales.append(loss_scale)
        self.update(obs.component, g.square(), weight)


def test_record_grad_gets_the_loss_scale_the_loop_set_before_backward() -> None:
    torch.manual_seed(1)
    body, head = nn.Linear(3, 4), nn.Linear(4, 1)
    policy = PolicyAutoBuilder.wrap(nn.Sequential(body, head), {"body": "0"})
    ctx = ComponentContext()
    probe = PerSampleGrad()
    policy.attach("body", probe, ctx)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    scales = []
    for xs, ys in zip(x.split([5, 3]), y.split([5, 3]), strict=True):  # two micro-batches
        loss = (policy(xs) - ys).square().mean()
        ctx.loss_scale = xs.shape[0] / x.shape[0]  # set after the forward
        scales.append(ctx.loss_scale)
        (loss * ctx.loss_scale).backward()
    ctx.loss_scale = 1.0
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    assert not ctx.probe_errors

    per_sample = []  # d l_i / d body(x_i), one sample at a time
    for xi, yi in zip(x, y, strict=True):
        h = body(xi[None]).detach().requires_grad_()
        ((head(h) - yi) ** 2).sum().backward()
        per_sample.append(h.grad[0])
    expected = torch.stack(per_sample).double().square().mean(0)
    assert probe.scales == scales == [5 / 8, 3 / 8]
    assert got["probes/per_sample/body/rows"] == 8
    assert got["probes/per_sample/body/mean"] == pytest.approx(expected.tolist(), rel=1e-5)
