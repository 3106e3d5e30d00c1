"""Fisher probe on conv, embedding, norm, recurrent and attention layers, against
per-sample gradients from torch.func.vmap(torch.func.grad(...)) (body_squared_gradients)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import float32_rtol
from test_probe_fisher import body_squared_gradients, per_sample_loss
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from policy_probes import (
    MLP,
    ComponentContext,
    PolicyAutoBuilder,
    ProbeSettings,
    StatsReporter,
    attach_fisher_information_hooks,
)

REL = 1e-5

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def image_batches(
    shape: tuple[int, ...],
    sizes: tuple[int, ...],
    seed: int = 3,
    device: torch.device | str = "cpu",
) -> Batches:
    """Seeded minibatches (x, action), drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    drawn = [
        (torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes
    ]
    return on(drawn, device)


def on(batches: Batches, device: torch.device | str) -> Batches:
    """``batches`` moved to ``device``."""
    return [(x.to(device), a.to(device)) for x, a in batches]


def to_device(device: torch.device | str, *modules: nn.Module) -> None:
    """Move modules built (and seeded) on the CPU to ``device``, in place."""
    for module in modules:
        module.to(device)


def probe_fisher(
    body: nn.Module,
    head: nn.Module,
    batches: Batches,
    *,
    micro: int = 1,
    reduction: str = "mean",
    **settings: object,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Train ``head(body(x))`` on ``batches`` (each split into ``micro`` micro-batches
    scaled by ``context.loss_scale``) with the Fisher probe on ``body``; its per-entry
    Fisher and the window's metrics."""
    model = PolicyAutoBuilder.wrap(
        nn.Sequential(body, head), {"body": "0", "head": "1"}, example_inputs=(batches[0][0][:2],)
    )
    ctx = ComponentContext()
    builder = attach_fisher_information_hooks(loss_reduction=reduction, **settings)
    model.attach("body", builder, ctx, backward=True)
    for x, a in batches:
        for xs, as_ in zip(x.chunk(micro), a.chunk(micro), strict=True):
            losses = per_sample_loss(model(xs), as_)
            if reduction == "mean":
                ctx.loss_scale = xs.shape[0] / x.shape[0]
                (losses.mean() * ctx.loss_scale).backward()
            else:
                losses.sum().backward()
    assert not ctx.probe_errors
    fisher = ctx.model_metrics["fisher"].param_fisher("body")
    metrics = StatsReporter(ctx).collect()
    model.remove_hooks()
    return fisher, metrics


def loop_squared_gradients(body: nn.Module, head: nn.Module, batches: Batches) -> dict:
    """Sum over all samples of the squared per-sample gradient of every parameter of
    ``body``, one autograd call per sample (for modules whose fused kernels vmap cannot
    batch, e.g. nn.GRU creating its own hidden state)."""
    names, params = zip(*body.named_parameters(), strict=True)
    sq = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in zip(names, params, strict=True)}
    for x, a in batches:
        for i in range(x.shape[0]):
            loss = per_sample_loss(head(body(x[i : i + 1])), a[i : i + 1])[0]
            for k, g in zip(names, torch.autograd.grad(loss, params), strict=True):
                sq[k] += g.double() ** 2
    return sq


def assert_matches_reference(
    body: nn.Module,
    head: nn.Module,
    batches: Batches,
    fisher: dict,
    metrics: dict,
    reference: Callable[[nn.Module, nn.Module, Batches], dict] = body_squared_gradients,
) -> None:
    sq = reference(body, head, batches)  # on the model's device: compared on the host
    n = sum(x.shape[0] for x, _ in batches)
    rtol = float32_rtol(body, REL)
    assert set(fisher) == set(sq)
    for name, value in sq.items():
        assert value.abs().sum() > 0, name  # a rule that sees nothing would pass otherwise
        torch.testing.assert_close(fisher[name].cpu(), value.cpu() / n, rtol=rtol, atol=1e-12)
    total = sum(v.sum().item() for v in sq.values()) / n
    assert metrics["probes/fisher/body/trace"] == pytest.approx(total, rel=rtol)
    assert metrics["probes/fisher/body/unsupported_params"] == 0


CONVS = {
    "conv2d": lambda: nn.Conv2d(3, 4, 3),
    "conv2d_stride_pad": lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 2)),
    "conv2d_dilation_groups_nobias": lambda: nn.Conv2d(
        4, 6, 3, dilation=2, groups=2, padding=1, bias=False
    ),
    "conv2d_reflect": lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
    "conv2d_circular_same": lambda: nn.Conv2d(3, 4, 4, padding="same", padding_mode="circular"),
    "conv2d_replicate_stride": lambda: nn.Conv2d(3, 2, 3, stride=2, padding=1,
                                                 padding_mode="replicate"),
    "conv2d_same_even": lambda: nn.Conv2d(3, 4, 4, padding="same"),
    "conv2d_depthwise": lambda: nn.Conv2d(4, 8, 3, groups=4),
}  # fmt: skip
CONV1DS = {
    "conv1d": lambda: nn.Conv1d(3, 4, 3),
    "conv1d_stride_dilation_groups": lambda: nn.Conv1d(
        4, 6, 3, stride=2, dilation=2, padding=2, groups=2
    ),
    "conv1d_reflect_nobias": lambda: nn.Conv1d(3, 5, 3, padding=1, padding_mode="reflect",
                                               bias=False),
    "conv1d_same_circular": lambda: nn.Conv1d(3, 4, 4, padding="same", padding_mode="circular"),
}  # fmt: skip


def conv_model(conv: nn.Module, in_shape: tuple[int, ...]) -> tuple[nn.Module, nn.Module]:
    body = nn.Sequential(conv, nn.Tanh(), nn.Flatten())
    with torch.no_grad():
        width = body(torch.zeros(1, *in_shape)).shape[1]
    return body, nn.Linear(width, 3)


@pytest.mark.parametrize("name", list(CONVS) + list(CONV1DS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv_fisher_matches_vmap(name: str, reduction: str, device: torch.device) -> None:
    torch.manual_seed(0)
    conv = (CONVS | CONV1DS)[name]()
    in_shape = (conv.in_channels, 7, 6) if name in CONVS else (conv.in_channels, 9)
    body, head = conv_model(conv, in_shape)
    to_device(device, body, head)
    batches = image_batches(in_shape, (10, 7), device=device)
    fisher, metrics = probe_fisher(body, head, batches, reduction=reduction)
    assert_matches_reference(body, head, batches, fisher, metrics)


@pytest.mark.parametrize("name", list(CONVS) + list(CONV1DS))
@pytest.mark.parametrize("method", ["correlate", "unfold"])
def test_both_conv_routes_give_each_samples_squared_gradient(
    name: str, method: str, device: torch.device
) -> None:
    """The conv rule's two routes (the correlation the CPU uses, the im2col contraction
    accelerators use) each give sum_i (dl_i/dW)^2 as autograd gives it one sample at a
    time, with chunks of one sample and of the whole batch; both routes run on every
    device (the method is named, not picked by the device)."""
    from policy_probes.probes.fisher_rules import ConvRule

    torch.manual_seed(0)
    conv = (CONVS | CONV1DS)[name]()
    in_shape = (conv.in_channels, 7, 6) if name in CONVS else (conv.in_channels, 9)
    x = torch.randn(5, *in_shape)
    with torch.no_grad():
        g = torch.randn_like(conv(x))  # each sample's loss is <g_i, conv(x_i)>; CPU draws
    conv, x, g = conv.to(device), x.to(device), g.to(device)
    out = conv(x)
    want = {key: torch.zeros_like(p, dtype=torch.float64) for key, p in conv.named_parameters()}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(conv(x[i : i + 1]), list(conv.parameters()), g[i : i + 1])
        for (key, _), grad in zip(conv.named_parameters(), grads, strict=True):
            want[key] += grad.double().square()
    rule = ConvRule.of(conv, ("weight", "bias" if conv.bias is not None else None), x, out)
    for chunk_bytes in (1, 1 << 30):
        got = rule.squares(x.reshape(5, -1), g.reshape(5, -1), chunk_bytes, method)
        assert set(got) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-9)


def test_the_correlation_stays_float32_where_cudnn_allows_tf32(device: torch.device) -> None:
    """cuDNN allows TF32 by default (10-bit mantissa): the correlation route turns it off
    for its convolution, and back on after. The reference is float64 autograd one sample
    at a time; a TF32 correlation misses it by ~1e-3."""
    from policy_probes.probes.fisher_rules import ConvRule

    torch.manual_seed(2)
    conv = nn.Conv2d(4, 8, 8, stride=4)  # NatureCNN's first layer, on 36x36 frames
    x = torch.rand(6, 4, 36, 36)
    with torch.no_grad():
        g = torch.randn_like(conv(x))
    conv, x, g = conv.to(device), x.to(device), g.to(device)
    want = torch.zeros_like(conv.weight, dtype=torch.float64)
    conv64 = copy.deepcopy(conv).double()
    for i in range(x.shape[0]):
        (grad,) = torch.autograd.grad(
            conv64(x[i : i + 1].double()), conv64.weight, g[i : i + 1].double()
        )
        want += grad.square()
    rule = ConvRule.of(conv, ("weight", None), x, conv(x))
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        got = rule.squares(x.reshape(6, -1), g.reshape(6, -1), 1 << 30, "correlate")
        assert torch.backends.cudnn.allow_tf32  # the user's setting is back
    finally:
        torch.backends.cudnn.allow_tf32 = allowed
    torch.testing.assert_close(got["weight"].double(), want, rtol=1e-5, atol=1e-9)


def test_stacked_convs_with_micro_batches_and_small_chunks(device: torch.device) -> None:
    """NatureCNN's layout (conv, ReLU, conv, ReLU, flatten, linear); the minibatch split
    into micro-batches (context.loss_scale) and chunks smaller than the batch give the
    same Fisher as one pass with no chunking."""
    torch.manual_seed(1)
    body = nn.Sequential(
        nn.Conv2d(2, 4, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 8),
        nn.ReLU(),
    )
    head = nn.Linear(8, 3)
    to_device(device, body, head)
    batches = image_batches((2, 10, 10), (12, 8), device=device)
    whole, metrics = probe_fisher(body, head, batches)
    assert_matches_reference(body, head, batches, whole, metrics)
    chunked, _ = probe_fisher(body, head, batches, micro=4, chunk_bytes=1)  # one sample a chunk
    for name, value in whole.items():
        torch.testing.assert_close(chunked[name].cpu(), value.cpu(), rtol=REL, atol=1e-12)


def index_batches(
    vocab: int, positions: int, sizes: tuple[int, ...], device: torch.device | str = "cpu"
) -> Batches:
    """Seeded minibatches (indices, action), drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(5)
    drawn = [
        (
            torch.randint(0, vocab, (n, positions), generator=g),
            torch.randint(0, 3, (n,), generator=g),
        )
        for n in sizes
    ]
    return on(drawn, device)


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 26])
def test_embedding_fisher_with_repeated_indices_and_padding(
    padding_idx: int | None, chunk_bytes: int, device: torch.device
) -> None:
    torch.manual_seed(2)
    body = nn.Sequential(nn.Embedding(6, 4, padding_idx=padding_idx), nn.Tanh(), nn.Flatten())
    head = nn.Linear(5 * 4, 3)
    to_device(device, body, head)
    batches = index_batches(6, 5, (9, 6), device)  # 5 positions from 6 indices: many repeats
    first = batches[0][0].cpu()
    assert any(len(set(row.tolist())) < 5 for row in first)
    assert any(0 in row.tolist() for row in first)
    fisher, metrics = probe_fisher(body, head, batches, chunk_bytes=chunk_bytes)
    if padding_idx is not None:  # the padding row never gets a gradient
        assert fisher["0.weight"][padding_idx].abs().sum() == 0
        fisher["0.weight"][padding_idx] = 0.0
    sq = body_squared_gradients(body, head, batches)
    n = 15
    for name, value in sq.items():
        torch.testing.assert_close(fisher[name].cpu(), value.cpu() / n, rtol=REL, atol=1e-12)
    assert metrics["probes/fisher/body/unsupported_params"] == 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_layer_norm_over_two_trailing_dims_and_group_norm(
    reduction: str, device: torch.device
) -> None:
    torch.manual_seed(3)
    body = nn.Sequential(
        nn.Conv2d(2, 6, 3),
        nn.GroupNorm(3, 6),
        nn.Tanh(),
        nn.LayerNorm((6, 4, 4)),  # affine over (C, H, W): every entry its own weight
        nn.Flatten(2),
        nn.LayerNorm((6, 16)),
        nn.Flatten(),
    )
    with torch.no_grad():  # affine parameters away from their (1, 0) start
        for m in (body[1], body[3], body[5]):
            m.weight.normal_()
            m.bias.normal_()
    head = nn.Linear(96, 3)
    to_device(device, body, head)
    batches = image_batches((2, 6, 6), (8, 5), device=device)
    fisher, metrics = probe_fisher(body, head, batches, reduction=reduction, chunk_bytes=2000)
    assert_matches_reference(body, head, batches, fisher, metrics)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_hidden_layers_with_and_without_a_layer_norm_before_the_activation(
    layer_norm: bool, device: torch.device
) -> None:
    """A HiddenLayer's Linear is read through its activation's output only when nothing
    stands between them: with layer_norm=True, act(norm(linear(x))), its output gradient
    is taken from the Linear itself (the norm's Jacobian is in it)."""
    torch.manual_seed(5)
    body = MLP(5, [6, 4], "tanh", layer_norm=layer_norm)
    if layer_norm:
        with torch.no_grad():  # affine parameters away from their (1, 0) start
            for name, p in body.named_parameters():
                if ".norm." in name:
                    p.normal_()
    head = nn.Linear(4, 3)
    to_device(device, body, head)
    batches = image_batches((5,), (9, 4), device=device)
    fisher, metrics = probe_fisher(body, head, batches)
    assert_matches_reference(body, head, batches, fisher, metrics)


class Recurrent(nn.Module):
    """(batch, time, features) -> mean hidden state over time, through an RNN module of
    either batch layout, or through an RNN cell stepped over time (one pass a step)."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.rnn, nn.RNNCellBase):
            state, hs = None, []
            for t in range(x.shape[1]):
                state = self.rnn(x[:, t], state)
                hs.append(state[0] if isinstance(state, tuple) else state)
            return torch.stack(hs, 1).mean(1)
        if not self.rnn.batch_first:
            x = x.transpose(0, 1)
        out, _ = self.rnn(x)
        return out.mean(1 if self.rnn.batch_first else 0)


RNNS = {
    "lstm": lambda: nn.LSTM(4, 5),
    "lstm_batch_first_2_layers": lambda: nn.LSTM(4, 5, num_layers=2, batch_first=True),
    "lstm_bidirectional_2_layers_no_bias": lambda: nn.LSTM(
        4, 5, num_layers=2, bidirectional=True, bias=False
    ),
    # projections: the torch.func route (the others: the gate-gradient rule)
    "lstm_bidirectional_proj": lambda: nn.LSTM(4, 6, proj_size=3, bidirectional=True),
    "gru": lambda: nn.GRU(4, 5),
    "gru_batch_first": lambda: nn.GRU(4, 5, batch_first=True),
    "gru_bidirectional_2_layers": lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True),
    "rnn_tanh": lambda: nn.RNN(4, 5, num_layers=2),
    "rnn_relu_batch_first": lambda: nn.RNN(4, 5, nonlinearity="relu", batch_first=True),
    "lstm_cell": lambda: nn.LSTMCell(4, 5),
    "gru_cell": lambda: nn.GRUCell(4, 5),
}


@pytest.mark.parametrize("name", list(RNNS))
def test_recurrent_layers_through_the_generic_route(name: str, device: torch.device) -> None:
    torch.manual_seed(4)
    rnn = RNNS[name]()
    body = Recurrent(rnn)
    with torch.no_grad():
        width = body(torch.zeros(1, 3, 4)).shape[-1]
    head = nn.Linear(width, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (9, 6), device=device)
    fisher, metrics = probe_fisher(body, head, batches)
    assert_matches_reference(body, head, batches, fisher, metrics, loop_squared_gradients)


@pytest.mark.parametrize(("micro", "reduction", "chunk_bytes"), [(3, "mean", 1), (1, "sum", 1)])
def test_generic_route_micro_batches_sum_loss_and_chunks(
    micro: int, reduction: str, chunk_bytes: int, device: torch.device
) -> None:
    torch.manual_seed(5)
    body = Recurrent(nn.LSTM(4, 5))
    head = nn.Linear(5, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (9, 6), device=device)
    fisher, metrics = probe_fisher(
        body, head, batches, micro=micro, reduction=reduction, chunk_bytes=chunk_bytes
    )
    assert_matches_reference(body, head, batches, fisher, metrics)


class Attention(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.attn.batch_first:
            x = x.transpose(0, 1)
        out, _ = self.attn(x, x, x)
        return out.mean(1 if self.attn.batch_first else 0)


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_through_the_generic_route(
    batch_first: bool, device: torch.device
) -> None:
    """out_proj is an nn.Linear the attention's forward never calls: it must go through
    the attention's generic unit, not a Linear hook that would never fire."""
    torch.manual_seed(6)
    body = Attention(batch_first)
    head = nn.Linear(4, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (7, 5), device=device)
    fisher, metrics = probe_fisher(body, head, batches)
    assert "attn.out_proj.weight" in fisher
    assert_matches_reference(body, head, batches, fisher, metrics)


class Scaled(nn.Module):
    """A user layer with a parameter of its own around a Linear, and buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.linear = nn.Linear(5, 6)
        self.register_buffer("offset", torch.linspace(-0.2, 0.2, 6))
        self.register_buffer("version", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.gain + self.offset)


def test_generic_off_lists_uncovered_parameters_by_name(
    caplog: pytest.LogCaptureFixture, device: torch.device
) -> None:
    torch.manual_seed(7)
    body = nn.Sequential(Recurrent(nn.GRU(4, 5)), nn.Linear(5, 4))
    head = nn.Linear(4, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (6,), device=device)
    with caplog.at_level(logging.WARNING, logger="policy_probes"):
        fisher, metrics = probe_fisher(body, head, batches, generic="off")
    gru = body[0].rnn
    expected = {f"0.rnn.{k}": p.numel() for k, p in gru.named_parameters()}
    listed = {
        k.removeprefix("probes/fisher/body/uncovered/"): v
        for k, v in metrics.items()
        if k.startswith("probes/fisher/body/uncovered/")
    }
    assert listed == expected
    assert metrics["probes/fisher/body/unsupported_params"] == 4
    assert set(fisher) == {"1.weight", "1.bias"}
    assert "generic='auto' covers them" in caplog.text
    # with the default the same model is covered entirely, exactly
    fisher, metrics = probe_fisher(body, head, batches)
    assert_matches_reference(body, head, batches, fisher, metrics, loop_squared_gradients)


def test_user_layer_with_own_parameter_goes_generic_as_a_whole(device: torch.device) -> None:
    torch.manual_seed(8)
    body = nn.Sequential(Scaled(), nn.Linear(6, 4))
    head = nn.Linear(4, 3)
    to_device(device, body, head)
    batches = image_batches((5,), (7, 4), device=device)
    fisher, metrics = probe_fisher(body, head, batches, micro=2)
    assert set(fisher) == {"0.gain", "0.linear.weight", "0.linear.bias", "1.weight", "1.bias"}
    assert_matches_reference(body, head, batches, fisher, metrics)


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.full((x.shape[0],), x.shape[1])
        _, (h, _) = self.lstm(pack_padded_sequence(x, lengths, batch_first=True))
        return h[-1]


def test_a_module_the_generic_route_cannot_split_is_reported_and_listed(
    caplog: pytest.LogCaptureFixture, device: torch.device
) -> None:
    torch.manual_seed(9)
    body = nn.Sequential(Packed(), nn.Linear(5, 4))
    head = nn.Linear(4, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (6, 5), device=device)
    with caplog.at_level(logging.WARNING, logger="policy_probes"):
        fisher, metrics = probe_fisher(body, head, batches)
    assert "PackedSequence" in caplog.text and "pass padded tensors instead" in caplog.text
    assert set(fisher) == {"1.weight", "1.bias"}  # the rest of the probe carries on
    lstm = body[0].lstm
    for k, p in lstm.named_parameters():
        assert metrics[f"probes/fisher/body/uncovered/0.lstm.{k}"] == p.numel()
    assert metrics["probes/fisher/body/unsupported_params"] == 4


def test_builder_rejects_bad_generic_and_chunk_settings() -> None:
    with pytest.raises(ValueError, match="generic must be 'auto' or 'off'"):
        attach_fisher_information_hooks(generic="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes must be an integer >= 1"):
        attach_fisher_information_hooks(chunk_bytes=0)


def test_sb3_nature_cnn_is_covered_entirely(device: torch.device) -> None:
    """The issue's encoder: SB3's NatureCNN (CnnPolicy) had every conv parameter left
    out; now every parameter is in the Fisher, exactly."""
    from gymnasium import spaces
    from stable_baselines3.common.torch_layers import NatureCNN

    torch.manual_seed(10)
    space = spaces.Box(0.0, 1.0, (2, 36, 36))
    body = NatureCNN(space, features_dim=8, normalized_image=True)
    head = nn.Linear(8, 3)
    batches = [(torch.rand(n, 2, 36, 36), torch.randint(0, 3, (n,))) for n in (6, 4)]
    to_device(device, body, head)
    batches = on(batches, device)
    fisher, metrics = probe_fisher(body, head, batches, chunk_bytes=1 << 16)
    assert_matches_reference(body, head, batches, fisher, metrics)
    conv = sum(v.sum().item() for k, v in fisher.items() if k.startswith("cnn."))
    assert metrics["probes/fisher/body/trace"] > conv > 0


@pytest.mark.parametrize("layer", ["conv", "lstm"])
def test_a_sample_with_a_non_finite_input_is_dropped(layer: str, device: torch.device) -> None:
    torch.manual_seed(11)
    if layer == "conv":
        body, head = conv_model(nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5))
        x, a = image_batches((2, 5, 5), (7,))[0]
    else:
        body, head = Recurrent(nn.LSTM(4, 5, batch_first=True)), nn.Linear(5, 3)
        x, a = image_batches((3, 4), (7,))[0]
    bad = x.clone()  # x, a on the CPU: poisoned and indexed here, then moved
    bad[2].view(-1)[1] = float("nan")
    to_device(device, body, head)
    # sum: sample 2 only poisons itself (its own loss and gradient)
    fisher, metrics = probe_fisher(body, head, on([(bad, a)], device), reduction="sum")
    keep = torch.arange(7) != 2
    sq = loop_squared_gradients(body, head, on([(x[keep], a[keep])], device))
    for name, value in sq.items():
        rtol = float32_rtol(body, REL)
        torch.testing.assert_close(fisher[name].cpu(), value.cpu() / 6, rtol=rtol, atol=1e-12)


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0].mean(1))


class LSTMOutput(nn.Module):
    """The LSTM's output sequence alone (for the reference)."""

    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.lstm = lstm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def test_component_that_is_itself_an_lstm(device: torch.device) -> None:
    """The layout of a recurrent policy's ``lstm_actor`` component: the probed module
    is the generic unit itself, its tuple output read through ``extractor``. The loss is
    a mean over sequences taken after the component (the head pools over time), which
    the probe cannot see from the component's (B, T, H) output: the loop states it with
    ``loss_samples`` (without it the factor is the B x T rows of that output)."""
    torch.manual_seed(12)
    net = LSTMNet().to(device)
    model = PolicyAutoBuilder.wrap(net, {"lstm": "lstm"})
    ctx = ComponentContext()
    builder = attach_fisher_information_hooks()
    model.attach("lstm", builder, ctx, backward=True, extractor=lambda out: out[0])
    batches = image_batches((3, 4), (6, 5), device=device)
    for x, a in batches:
        ctx.loss_samples = x.shape[0]
        per_sample_loss(model(x), a).mean().backward()
    ctx.loss_samples = None
    assert not ctx.probe_errors
    fisher = ctx.model_metrics["fisher"].param_fisher("lstm")
    model.remove_hooks()
    sq = loop_squared_gradients(LSTMOutput(net.lstm), lambda h: net.head(h.mean(1)), batches)
    assert set(fisher) == {k.removeprefix("lstm.") for k in sq}
    for name, value in sq.items():
        torch.testing.assert_close(
            fisher[name.removeprefix("lstm.")].cpu(),
            value.cpu() / 11,
            rtol=float32_rtol(net, REL),
            atol=1e-12,
        )


def test_param_every_counts_backwards_on_the_generic_route(device: torch.device) -> None:
    """A cell stepped over time makes several passes per backward; param_every=2 keeps
    every other backward with all of its steps (the per-sample sum over steps)."""
    torch.manual_seed(13)
    body, head = Recurrent(nn.GRUCell(4, 5)), nn.Linear(5, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (6, 5, 7, 4), device=device)
    fisher, _ = probe_fisher(body, head, batches, param_every=2)
    sq = loop_squared_gradients(body, head, batches[::2])
    for name, value in sq.items():
        torch.testing.assert_close(fisher[name].cpu(), value.cpu() / 13, rtol=REL, atol=1e-12)


def test_dropout_and_batch_norm_are_listed_with_the_reason(
    caplog: pytest.LogCaptureFixture, device: torch.device
) -> None:
    """No exact per-sample gradient: a re-run draws new dropout masks, and batch norm
    mixes the batch into every sample's gradient. Both are listed, the rest is exact."""
    torch.manual_seed(14)
    rnn = Recurrent(nn.LSTM(4, 5, num_layers=2, dropout=0.3, batch_first=True))
    body = nn.Sequential(rnn, nn.BatchNorm1d(5), nn.Linear(5, 4))
    head = nn.Linear(4, 3)
    to_device(device, body, head)
    batches = image_batches((3, 4), (6, 5), device=device)
    with caplog.at_level(logging.WARNING, logger="policy_probes"):
        fisher, metrics = probe_fisher(body, head, batches)
    assert "applies dropout in training mode" in caplog.text
    assert "batch norm" in caplog.text
    assert set(fisher) == {"2.weight", "2.bias"}
    listed = {
        k.removeprefix("probes/fisher/body/uncovered/")
        for k in metrics
        if k.startswith("probes/fisher/body/uncovered/")
    }
    expected = {f"0.rnn.{k}" for k, _ in rnn.rnn.named_parameters()} | {"1.weight", "1.bias"}
    assert listed == expected
    assert metrics["probes/fisher/body/uncovered/1.weight"] == 5


class TinyImageEnv(gym.Env):
    """36 x 36 grey frames (the smallest NatureCNN takes), 3 actions, 8-step episodes."""

    observation_space = gym.spaces.Box(0, 255, (36, 36, 1), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action: int) -> tuple:
        self.t += 1
        reward = float(action == 1)
        return self.observation_space.sample(), reward, self.t >= 8, False, {}


def test_sb3_cnn_policy_features_fisher_covers_the_convolutions(tmp_path: Path) -> None:
    """The issue's run: PPO("CnnPolicy") with the Fisher probe on ``features``; every
    parameter of the encoder is covered and the convolutions are in the trace."""
    from stable_baselines3 import PPO

    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.records import read_jsonl
    from policy_probes.sinks import SinksConfig

    env = TinyImageEnv()
    env.observation_space.seed(0)
    model = PPO("CnnPolicy", env, n_steps=16, batch_size=16, n_epochs=1, device="cpu", seed=0)
    callback = ProbeCallback(
        backward_probes=[("features", attach_fisher_information_hooks())],
        run_dir=tmp_path,
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False)),
    )
    model.learn(16, callback=callback)
    (rec,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    prefix = "probes/fisher/features/"
    assert rec[prefix + "unsupported_params"] == 0
    names = [n for n, _ in model.policy.features_extractor.named_parameters()]
    traces = {n: rec[f"{prefix}{n}.trace"] for n in names}
    assert all(v > 0 for v in traces.values())
    assert rec[prefix + "trace"] == pytest.approx(sum(traces.values()), rel=1e-9)
    assert sum(v for n, v in traces.items() if n.startswith("cnn.")) > 0


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.contiguous(memory_format=torch.channels_last)).flatten(1)


LAYOUTS = {
    # channels_last: vmap cannot clone to that format, so the loop reference
    "conv_channels_last": lambda: (
        ChannelsLast(),
        nn.Linear(100, 3),
        image_batches((3, 7, 7), (5, 4)),
        loop_squared_gradients,
    ),
    "embedding_1d_indices": lambda: (
        nn.Sequential(nn.Embedding(7, 4), nn.Tanh()),
        nn.Linear(4, 3),
        [(torch.randint(0, 7, (9,)), torch.randint(0, 3, (9,)))],
        body_squared_gradients,
    ),
    "layer_norm_without_bias": lambda: (
        nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6, bias=False), nn.Tanh()),
        nn.Linear(6, 3),
        image_batches((5,), (8,)),
        body_squared_gradients,
    ),
    "group_norm_on_features": lambda: (
        nn.Sequential(nn.Linear(5, 6), nn.GroupNorm(2, 6), nn.Tanh()),
        nn.Linear(6, 3),
        image_batches((5,), (8,)),
        body_squared_gradients,
    ),
    "conv3d_generic": lambda: (
        nn.Sequential(nn.Conv3d(2, 3, 2), nn.Tanh(), nn.Flatten()),
        nn.Linear(24, 3),
        image_batches((2, 3, 3, 3), (6,)),
        body_squared_gradients,
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_more_layouts(name: str, device: torch.device) -> None:
    torch.manual_seed(15)
    body, head, batches, reference = LAYOUTS[name]()  # built on the CPU, then moved
    to_device(device, body, head)
    batches = on(batches, device)
    fisher, metrics = probe_fisher(body, head, batches)
    assert_matches_reference(body, head, batches, fisher, metrics, reference)


class TwoCalls(nn.Module):
    """One LSTM over two halves of each sample's sequence, with the final state of the
    first as the initial state of the second: two passes of the unit per backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, state = self.lstm(x[:, :2])
        second, _ = self.lstm(x[:, 2:], state)
        return torch.cat([first, second], 1).mean(1)


def test_an_rnn_called_twice_per_forward_sums_each_samples_gradient(device: torch.device) -> None:
    torch.manual_seed(16)
    body, head = TwoCalls(), nn.Linear(5, 3)
    to_device(device, body, head)
    batches = image_batches((5, 4), (7, 6), device=device)
    fisher, metrics = probe_fisher(body, head, batches, micro=2)
    assert_matches_reference(body, head, batches, fisher, metrics, loop_squared_gradients)


class InPlaceAfter(nn.Module):
    """A GRU cell whose output is changed in place right after it (a hook on that
    tensor would never be called)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cell(x[:, 0], x[:, 1, :1].expand(-1, 5).contiguous())
        h[:, 0] = 0.0
        return h.mul_(2.0)


def test_in_place_ops_on_a_generic_units_output_keep_it_covered(device: torch.device) -> None:
    torch.manual_seed(17)
    body, head = InPlaceAfter(), nn.Linear(5, 3)
    to_device(device, body, head)
    batches = image_batches((2, 4), (6, 5), device=device)
    fisher, metrics = probe_fisher(body, head, batches)
    assert_matches_reference(body, head, batches, fisher, metrics, loop_squared_gradients)
