"""Row masks on every Fisher route (conv, embedding, group norm, the generic torch.func
route, the LSTM gate-gradient rule): the per-parameter Fisher over exactly the kept
samples, against a plain per-sample autograd loop.

A sample is what the route calls one: dimension 0 of a conv, embedding or group-norm
input, the batch index of a generic unit (an LSTM's sequence). Its loss is the masked
sum of its rows' losses, ``l_s = sum_t m_st l_st``; a sample is kept when any of its rows
is, and ``param_samples`` counts the kept samples."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import float32_rtol, sb3_cartpole
from test_probe_fisher import per_sample_loss
from torch import nn
from torch.func import functional_call

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeSettings,
    StatsReporter,
    attach_fisher_information_hooks,
)

REL = 1e-5
B, T, C = 6, 4, 3

Run = Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]


class Net(nn.Module):
    """``run(body, head, x)``: logits ``(B, C)`` or ``(B, T, C)`` from batch-major ``x``."""

    def __init__(self, body: nn.Module, head: nn.Module, run: Run) -> None:
        super().__init__()
        self.body, self.head, self.run = body, head, run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.body, self.head, x)


def row_losses(logits: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per-row losses shaped like ``a`` ((B,) or (B, T))."""
    return per_sample_loss(logits.reshape(-1, C), a.reshape(-1)).reshape(a.shape)


def batches(
    make_x: Callable[[torch.Generator, int], torch.Tensor],
    sequence: bool,
    device: torch.device | str = "cpu",
) -> list:
    """Two minibatches (x, a, mask): per-sample masks (B,), or (B, T) masks with a padded
    tail, a masked middle step and one sequence with no kept step; drawn on the CPU and
    moved to ``device``."""
    g = torch.Generator().manual_seed(11)
    out = []
    for n in (B, B - 2):
        x = make_x(g, n)
        if sequence:
            a = torch.randint(0, C, (n, T), generator=g)
            m = (torch.rand(n, T, generator=g) > 0.3).float()
            m[0] = 1.0
            m[1] = 0.0  # no kept step: no sample
            m[2, 1] = 0.0
            m[2, 0] = 1.0
            m[3, 0], m[3, 1:] = 0.0, 1.0  # first step masked, the rest kept
        else:
            a = torch.randint(0, C, (n,), generator=g)
            m = torch.ones(n)
            m[1] = m[n - 1] = 0.0
            if x.is_floating_point():  # masked samples far off: counted, they would show
                x[1] = x[1] * 40
        out.append((x.to(device), a.to(device), m.to(device)))
    return out


def probe(
    net: Net, data: list, micro: int, reduction: str, **placement: object
) -> tuple[dict, dict, dict]:
    """The probe's per-entry Fisher of ``body``, its param_samples and the metrics, from
    a masked loss over every minibatch (split into ``micro`` micro-batches)."""
    policy = PolicyAutoBuilder.wrap(net, {"body": "body"})
    ctx = ComponentContext()
    policy.attach(
        "body",
        attach_fisher_information_hooks(loss_reduction=reduction),
        ctx,
        backward=True,
        **placement,
    )
    for x, a, m in data:
        kept = m.sum()
        for xs, as_, ms in zip(x.chunk(micro), a.chunk(micro), m.chunk(micro), strict=True):
            ctx.row_mask = ms
            ctx.loss_samples = kept  # the loss averages over the whole minibatch's kept rows
            loss = (row_losses(net(xs), as_) * ms).sum()
            (loss / kept if reduction == "mean" else loss).backward()
    ctx.row_mask, ctx.loss_samples = None, None
    tracker = ctx.model_metrics["fisher"]
    fisher = tracker.param_fisher("body")
    counts = {
        k.removeprefix("param_samples:"): int(v)
        for k, v in tracker.state["body"].items()
        if k.startswith("param_samples:")
    }
    metrics = StatsReporter(ctx).collect()
    policy.remove_hooks()
    assert not ctx.probe_errors
    return fisher, counts, metrics


def reference(net: Net, data: list) -> tuple[dict, int]:
    """Mean over kept samples of the squared gradient of ``l_s = sum_t m_st l_st``, one
    autograd call per kept sample (a sample alone through the plain modules)."""
    names, params = zip(*net.body.named_parameters(), strict=True)
    sq = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in zip(names, params, strict=True)}
    n = 0
    for x, a, m in data:
        for s in range(x.shape[0]):
            if not m[s].any():
                continue
            loss = (row_losses(net(x[s : s + 1]), a[s : s + 1]) * m[s : s + 1]).sum()
            for k, g in zip(names, torch.autograd.grad(loss, params), strict=True):
                sq[k] += g.double() ** 2
            n += 1
    return {k: v / n for k, v in sq.items()}, n


def check(net: Net, data: list, micro: int, reduction: str) -> None:
    # nn.MultiheadAttention returns (output, weights): the unit Fisher reads the output
    extractor = 0 if isinstance(net.body, nn.MultiheadAttention) else None
    fisher, counts, metrics = probe(net, data, micro, reduction, extractor=extractor)
    ref, n = reference(net, data)  # on the model's device: compared on the host
    assert set(fisher) == set(ref)
    rtol = float32_rtol(net, REL)
    for name, value in ref.items():
        assert value.abs().sum() > 0, name
        torch.testing.assert_close(fisher[name].cpu(), value.cpu(), rtol=rtol, atol=1e-12)
        assert counts[name] == n, name  # kept samples only
        assert metrics[f"probes/fisher/body/{name}.trace"] == pytest.approx(
            value.sum().item(), rel=rtol
        )
    assert metrics["probes/fisher/body/unsupported_params"] == 0


def images(shape: tuple[int, ...]) -> Callable[[torch.Generator, int], torch.Tensor]:
    return lambda g, n: torch.randn(n, *shape, generator=g)


def head_on_body(body: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return head(body(x))


def lstm_time_major(body: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return head(body(x.transpose(0, 1))[0]).transpose(0, 1)


def lstm_per_step(body: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One call of (1, B, F) per step, the state carried (SB3's RecurrentPPO loop)."""
    xt, state, outs = x.transpose(0, 1), None, []
    for t in range(xt.shape[0]):
        out, state = body(xt[t : t + 1], state)
        outs.append(out)
    return head(torch.cat(outs)).transpose(0, 1)


def cell_per_step(body: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    state, outs = None, []
    for t in range(x.shape[1]):
        state = body(x[:, t], state)
        outs.append(state[0])
    return head(torch.stack(outs, 1))


def attention(body: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q = x.transpose(0, 1)  # (L, N, E): batch_first=False
    return head(body(q, q, q, need_weights=False)[0]).transpose(0, 1)


class Gated(nn.Module):
    """A user layer with its own parameters (torch.func route), batch along dim 0."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.gate = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) * torch.sigmoid(self.gate)


CASES = {
    # name: (body, head, run, make_x, sequence mask)
    "conv2d": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten()),
        lambda: nn.Linear(4 * 5 * 5, C),
        head_on_body,
        images((3, 5, 5)),
        False,
    ),
    "group_norm": (
        lambda: nn.Sequential(nn.GroupNorm(2, 4), nn.Flatten()),
        lambda: nn.Linear(4 * 3 * 3, C),
        head_on_body,
        images((4, 3, 3)),
        False,
    ),
    "embedding_per_token_mask": (
        lambda: nn.Embedding(7, 5, padding_idx=0),
        lambda: nn.Linear(5, C),
        head_on_body,
        lambda g, n: torch.randint(0, 7, (n, T), generator=g),
        True,
    ),
    "lstm_time_major": (
        lambda: nn.LSTM(3, 5),
        lambda: nn.Linear(5, C),
        lstm_time_major,
        images((T, 3)),
        True,
    ),
    "lstm_per_step": (
        lambda: nn.LSTM(3, 5),
        lambda: nn.Linear(5, C),
        lstm_per_step,
        images((T, 3)),
        True,
    ),
    "lstm_cell_per_step": (
        lambda: nn.LSTMCell(3, 5),
        lambda: nn.Linear(5, C),
        cell_per_step,
        images((T, 3)),
        True,
    ),
    "attention": (
        lambda: nn.MultiheadAttention(4, 2),
        lambda: nn.Linear(4, C),
        attention,
        images((T, 4)),
        True,
    ),
    "user_layer": (
        lambda: Gated(4),
        lambda: nn.Linear(4, C),
        head_on_body,
        images((4,)),
        False,
    ),
}


@pytest.mark.parametrize(("reduction", "micro"), [("mean", 1), ("mean", 2), ("sum", 2)])
@pytest.mark.parametrize("case", list(CASES))
def test_masked_fisher_on_every_route_matches_a_per_sample_loop(
    case: str, reduction: str, micro: int, device: torch.device
) -> None:
    body, head, run, make_x, sequence = CASES[case]
    torch.manual_seed(0)
    net = Net(body(), head(), run).to(device)
    check(net, batches(make_x, sequence, device), micro, reduction)


def test_a_flat_mask_on_a_time_major_lstm_is_read_in_its_row_order(device: torch.device) -> None:
    """A (T*B,) mask in the (time, batch) row order of an nn.LSTM without batch_first
    gives the same Fisher as the (B, T) mask."""
    torch.manual_seed(1)
    net = Net(nn.LSTM(3, 5), nn.Linear(5, C), lstm_time_major).to(device)
    data = batches(images((T, 3)), True, device)
    flat = [(x, a, m) for x, a, m in data]
    got2d, counts2d, _ = probe(net, data, 1, "mean")
    policy = PolicyAutoBuilder.wrap(net, {"body": "body"})
    ctx = ComponentContext()
    policy.attach("body", attach_fisher_information_hooks(), ctx, backward=True)
    for x, a, m in flat:
        ctx.row_mask = m.T.reshape(-1)  # time-major rows
        ((row_losses(net(x), a) * m).sum() / m.sum()).backward()
    ctx.row_mask = None
    tracker = ctx.model_metrics["fisher"]
    got1d = tracker.param_fisher("body")
    policy.remove_hooks()
    assert not ctx.probe_errors
    for name, value in got2d.items():
        torch.testing.assert_close(got1d[name].cpu(), value.cpu(), rtol=REL, atol=1e-12)
        assert int(tracker.state["body"][f"param_samples:{name}"]) == counts2d[name]


def test_a_mask_that_fits_no_sample_layout_disables_the_probe_with_the_shapes(
    device: torch.device,
) -> None:
    net = Net(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), nn.Linear(4 * 3 * 3, C), head_on_body
    ).to(device)
    policy = PolicyAutoBuilder.wrap(net, {"body": "body"})
    ctx = ComponentContext()
    policy.attach("body", attach_fisher_information_hooks(), ctx, backward=True)
    x = torch.randn(4, 3, 5, 5).to(device)
    ctx.row_mask = torch.ones(5).to(device)
    per_sample_loss(net(x), torch.zeros(4, dtype=torch.long).to(device)).mean().backward()
    policy.remove_hooks()
    assert "fisher/body" in ctx.probe_errors
    assert "(5,)" in ctx.probe_errors["fisher/body"]


def test_recurrent_ppo_lstm_weights_get_their_masked_fisher(tmp_path) -> None:
    """RecurrentPPO with the Fisher probe on lstm_actor: the LSTM's weights are covered
    (not unsupported) and their Fisher is, per sequence with a real step, the square of
    (real steps x the vector-Jacobian product of every LSTM call of the minibatch),
    re-run here on each sequence alone with plain autograd."""

    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.sinks import SinksConfig

    model = sb3_cartpole(recurrent=True, hidden=(8,), lstm_hidden_size=6)
    lstm = model.policy.lstm_actor
    masks: list[torch.Tensor] = []
    plain_get_samples = model.rollout_buffer._get_samples

    def get_samples(*args, **kwargs):
        sample = plain_get_samples(*args, **kwargs)
        masks.append(sample.mask.reshape(sample.lstm_states.pi[0].shape[1], -1).bool())
        return sample

    model.rollout_buffer._get_samples = get_samples
    calls: list[dict] = []  # every training call: inputs, states and output gradients

    def record(_m, args, out) -> None:
        if not out[0].requires_grad:
            return
        call = {
            "x": args[0].detach(),
            "hx": [h.detach() for h in args[1]],
            "g": [None] * 3,
            "params": {k: q.detach().clone() for k, q in lstm.named_parameters()},
        }
        for i, t in enumerate((out[0], *out[1])):  # None: no gradient reached it
            t.register_hook(lambda g, i=i: call["g"].__setitem__(i, g))
        calls.append(call)

    handle = lstm.register_forward_hook(record)  # before the probe's: the plain outputs
    callback = ProbeCallback(
        backward_probes=[("lstm_actor", attach_fisher_information_hooks())],
        run_dir=tmp_path / "run",
        probing=ProbeSettings(sinks=SinksConfig(console=False), strict=True, probe_budget=None),
    )
    model.learn(32, callback=callback)
    handle.remove()
    record_ = callback.history[-1]
    p = "probes/fisher/lstm_actor/"
    assert record_[p + "unsupported_params"] == 0
    assert masks and sum(int((~m).sum()) for m in masks) > 0  # padded steps were there

    names = [k for k, _ in lstm.named_parameters()]
    sq = {k: torch.zeros_like(q, dtype=torch.float64) for k, q in lstm.named_parameters()}
    n, j = 0, 0
    for m in masks:
        steps = m.shape[1]
        k = 1 if calls[j]["x"].shape[0] == steps else steps
        group, j = calls[j : j + k], j + k
        for s in range(m.shape[0]):
            if not m[s].any():
                continue
            total = 0.0
            # the parameters of this minibatch's forward (the optimiser steps after it)
            params = {k: q.requires_grad_(True) for k, q in group[0]["params"].items()}
            for c in group:
                hx = tuple(h[:, s : s + 1] for h in c["hx"])
                out, (h, cc) = functional_call(lstm, params, (c["x"][:, s : s + 1], hx))
                for t, g in zip((out, h, cc), c["g"], strict=True):
                    if g is not None:
                        total = total + (t * g[:, s : s + 1]).sum()
            grads = torch.autograd.grad(total * m.sum(), [params[k] for k in names])
            for name, gr in zip(names, grads, strict=True):
                sq[name] += gr.double() ** 2
            n += 1
    assert j == len(calls)
    for name, value in sq.items():
        assert value.abs().sum() > 0, name
        assert record_[f"{p}{name}.trace"] == pytest.approx(value.sum().item() / n, rel=REL)
