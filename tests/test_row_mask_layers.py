"""Row masks with conv layouts and per-layer keys, against plain torch over the kept rows.

* a conv output read per channel: the mask has one entry per sample; every position of a
  kept sample is a row, and ``samples`` counts kept samples (Conv1d and Conv2d);
* per-layer keys (``probes/<probe>/<component>.<layer>/...``) leave masked rows out like
  the component's own key, gradients included, also for a component called once per
  step under a ``(batch, time)`` mask (gradients arrive in reverse step order there);
* the recurrent default extractor with per-layer probing and with key, index and
  callable extractors.

References are plain forward hooks and ``torch.autograd.grad``, with the kept rows picked
by boolean indexing in the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_recurrent import BETA, F_IN, REL, B, H, Recorder, T, ema_reference, sequences
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeError,
    StatsReporter,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)


def channel_rows(t: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) -> (B * positions, C), float64."""
    return t.movedim(1, -1).reshape(-1, t.shape[1]).double()


def conv_batches(
    dims: int, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Minibatches whose masked samples are far out of distribution (x * 40); the last
    one is masked entirely. Drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n, masked in ((5, (1, 3)), (4, (0,)), (3, (0, 1, 2))):
        x = torch.randn(n, 2, *([6] * dims), generator=g)
        a = torch.randint(0, 3, (n,), generator=g)
        m = torch.ones(n)
        m[list(masked)] = 0.0
        x[m == 0] *= 40
        out.append((x.to(device), a.to(device), m.to(device)))
    return out


@pytest.mark.parametrize("dims", [1, 2])
def test_a_masked_conv_output_is_read_per_channel_over_the_kept_samples(
    dims: int, device: torch.device
) -> None:
    torch.manual_seed(0)
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    encoder = nn.Sequential(conv(2, 4, 3), nn.ReLU(), conv(4, 3, 1), nn.Tanh())
    model = nn.Sequential(encoder, nn.Flatten(), nn.Linear(3 * 4**dims, 3)).to(device)
    policy = PolicyAutoBuilder.wrap(model, {"encoder": "0"})
    ctx = ComponentContext()
    policy.attach("encoder", attach_relu_activation_hooks(), ctx)
    policy.attach("encoder", attach_saturated_activation_hooks("tanh", threshold=0.5), ctx)
    policy.attach("encoder", attach_gradient_flow_hooks(beta=BETA), ctx, backward=True)
    policy.attach("encoder", attach_relu_gradient_flow_hooks(), ctx, backward=True)
    rec = Recorder({"relu": encoder[1], "tanh": encoder[3]})
    data = conv_batches(dims, device)
    for x, a, m in data:
        ctx.row_mask = m
        losses = F.cross_entropy(policy(x), a, reduction="none")
        ((losses * m).sum() / m.sum().clamp(min=1)).backward()
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    rec.remove()
    policy.remove_hooks()
    assert not ctx.probe_errors

    keep = [m.bool() for _, _, m in data]
    kept = int(sum(k.sum() for k in keep))
    assert kept == 6

    def kept_rows(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([channel_rows(t[k]) for t, k in zip(ts, keep, strict=True)])

    relu, tanh = kept_rows(rec.out["relu"]), kept_rows(rec.out["tanh"])
    for key, h in (("encoder", tanh), ("encoder.1", relu), ("encoder.3", tanh)):
        p = f"probes/relu/{key}/"
        active = (h > 0).double().mean(0).cpu().tolist()
        assert got[p + "active_rate"] == pytest.approx(active, rel=REL)
        assert got[p + "zero_fraction"] == pytest.approx(float((h <= 0).double().mean()), rel=REL)
        assert got[p + "samples"] == kept
    for key in ("encoder", "encoder.3"):
        p = f"probes/saturation_tanh/{key}/"
        rate = (tanh.abs() > 0.5).double().mean(0)
        assert got[p + "saturation_rate"] == pytest.approx(rate.cpu().tolist(), rel=REL)
        assert got[p + "mean_derivative"] == pytest.approx(float((1 - tanh**2).mean()), rel=REL)
        assert got[p + "samples"] == kept
    # the masked samples (x * 40) saturate: counting them would change the rate
    every = torch.cat([channel_rows(t) for t in rec.out["tanh"]])
    assert (every.abs() > 0.5).double().mean() > (tanh.abs() > 0.5).double().mean() + 0.05
    # gradient flow: per pass, the RMS over the kept samples' positions; the fully
    # masked pass is no pass
    for key, name in (("encoder", "tanh"), ("encoder.1", "relu"), ("encoder.3", "tanh")):
        rms = [
            channel_rows(g[k]).square().mean(0).sqrt()
            for g, k in zip(rec.grad[name], keep, strict=True)
            if k.any()
        ]
        p = f"probes/gradient_flow/{key}/"
        assert got[p + "passes"] == 2
        assert got[p + "rms"] == pytest.approx(ema_reference(rms).cpu().tolist(), rel=REL)
    passed = torch.cat(
        [
            channel_rows(((g != 0) & (o > 0))[k])
            for o, g, k in zip(rec.out["relu"], rec.grad["relu"], keep, strict=True)
        ]
    )
    p = "probes/relu_gradient_flow/encoder.1/"
    assert got[p + "pass_rate"] == pytest.approx(passed.double().mean(0).cpu().tolist(), rel=REL)


class StepCore(nn.Module):
    """One step of a recurrent core: an LSTM cell, a tanh activation layer and a linear
    read-out; returns ``(read-out, (h, c))``."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(F_IN, H)
        self.act = nn.Tanh()
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, state=None):
        h, c = self.cell(x, state)
        return self.out(self.act(h)), (h, c)


class StepNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core = StepCore()
        self.head = nn.Linear(H, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, 2) logits for x of shape (T, B, F_IN), the core called once per step."""
        outs, state = [], None
        for t in range(T):
            y, state = self.core(x[t], state)
            outs.append(y)
        return self.head(torch.stack(outs, dim=1))


def masked_mean(logits: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits.reshape(-1, 2), a.reshape(-1), reduction="none")
    return (losses.reshape(B, T) * mask).sum() / mask.sum()


@pytest.mark.parametrize("extractor", [0, lambda out: out[0]])
def test_per_layer_keys_of_a_per_step_core_leave_masked_rows_out(
    extractor, device: torch.device
) -> None:
    torch.manual_seed(0)
    net = StepNet().to(device)
    policy = PolicyAutoBuilder.wrap(net, {"core": "core"})
    ctx = ComponentContext()
    policy.attach("core", attach_relu_activation_hooks(), ctx, extractor=extractor)
    sat = attach_saturated_activation_hooks("tanh", threshold=0.5)
    policy.attach("core", sat, ctx, extractor=extractor)
    flow = attach_gradient_flow_hooks(beta=BETA)
    policy.attach("core", flow, ctx, backward=True, extractor=extractor)
    rec = Recorder({"act": net.core.act})
    rec_core = Recorder({"core": net.core}, pick=lambda out: out[0])
    x, a, mask = (t.to(device) for t in sequences())  # drawn on the CPU, then moved
    ctx.row_mask = mask
    masked_mean(net(x), a, mask).backward()
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    rec.remove()
    rec_core.remove()
    policy.remove_hooks()
    assert not ctx.probe_errors
    rec.out.update(rec_core.out)
    rec.grad.update(rec_core.grad)

    # step t reads column t of the (batch, time) mask, in forward order
    def kept(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t[mask[:, i].bool()] for i, t in enumerate(ts)]).double()

    n = int(mask.sum())
    for key, name in (("core", "core"), ("core.act", "act")):
        h, g = kept(rec.out[name]), kept(rec.grad[name])
        p = f"probes/relu/{key}/"
        active = (h > 0).double().mean(0).cpu().tolist()
        assert got[p + "active_rate"] == pytest.approx(active, rel=REL)
        assert got[p + "samples"] == n
        # one row_mask block is one pass; gradients arrive last step first
        p = f"probes/gradient_flow/{key}/"
        assert got[p + "passes"] == 1
        assert got[p + "rms"] == pytest.approx(g.square().mean(0).sqrt().cpu().tolist(), rel=REL)
    h = kept(rec.out["act"])
    p = "probes/saturation_tanh/core.act/"
    rate = (h.abs() > 0.5).double().mean(0)
    assert got[p + "saturation_rate"] == pytest.approx(rate.cpu().tolist(), rel=REL)
    assert got[p + "samples"] == n


def test_recurrent_cores_have_no_layer_keys_and_an_extractor_overrides_the_default(
    device: torch.device,
) -> None:
    """An nn.GRU component: per-layer probing finds no activation layer inside it (no
    ``core.*`` keys, no errors); the default reads ``output``, ``extractor=1`` reads
    ``h_n`` instead, and a key extractor reads a TensorDictModule's GRU output."""
    tensordict = pytest.importorskip("tensordict")
    from tensordict.nn import TensorDictModule

    torch.manual_seed(0)
    gru = nn.GRU(F_IN, H)
    x = torch.randn(T, B, F_IN)
    gru, x = gru.to(device), x.to(device)  # built and drawn on the CPU, then moved
    reads = {}
    for extractor in (None, 1, lambda out: out[0]):
        policy = PolicyAutoBuilder.wrap(nn.Sequential(gru), {"core": gru})
        ctx = ComponentContext()
        policy.attach("core", attach_relu_activation_hooks(), ctx, extractor=extractor)
        policy.attach("core", attach_gradient_flow_hooks(), ctx, backward=True, extractor=extractor)
        out, h_n = gru(x)
        out.sum().backward()
        got = StatsReporter(ctx).collect()
        policy.remove_hooks()
        assert not ctx.probe_errors
        assert not [k for k in got if "/core." in k]
        reads[extractor if extractor in (None, 1) else "callable"] = got
    out, h_n = (t.detach() for t in gru(x))
    for name, h in ((None, out.reshape(-1, H)), (1, h_n.reshape(-1, H))):
        assert reads[name]["probes/relu/core/samples"] == h.shape[0]
        active = (h > 0).double().mean(0)
        assert reads[name]["probes/relu/core/active_rate"] == pytest.approx(active.cpu().tolist())
    assert reads["callable"].keys() == reads[None].keys()
    for key, value in reads[None].items():
        assert reads["callable"][key] == pytest.approx(value), key
    # h_n gets no gradient from out.sum(): only the default and the callable see one
    assert "probes/gradient_flow/core/rms" in reads[None]
    assert "probes/gradient_flow/core/rms" not in reads[1]

    # a TensorDictModule around the GRU is no recurrent module: a key picks the tensor
    body = TensorDictModule(gru, in_keys=["x"], out_keys=["seq", "h_n"])
    policy = PolicyAutoBuilder.wrap(nn.ModuleDict({"body": body}), {"body": body})
    ctx = ComponentContext(strict=True)
    policy.attach("body", attach_relu_activation_hooks(), ctx)
    with pytest.raises(ProbeError, match='extractor="seq"'):
        body(tensordict.TensorDict({"x": x}, batch_size=[]))
    policy.remove_hooks()
    ctx = ComponentContext()
    policy.attach("body", attach_relu_activation_hooks(), ctx, extractor="seq")
    mask = torch.ones(T * B)
    mask[:4] = 0
    mask = mask.to(device)
    ctx.row_mask = mask
    body(tensordict.TensorDict({"x": x}, batch_size=[]))
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    h = out.reshape(-1, H)[mask.bool()]
    assert got["probes/relu/body/samples"] == T * B - 4
    active = (h > 0).double().mean(0)
    assert got["probes/relu/body/active_rate"] == pytest.approx(active.cpu().tolist(), rel=REL)
