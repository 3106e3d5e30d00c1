"""Activation probes on conv outputs: per-channel metrics against numpy on the recorded
activations and on gradients from torch.autograd.grad."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    StatsReporter,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.probes.layout import output_channels_first, resolve_channels_first

REL = 1e-6


class ConvPolicy(PolicyAutoBuilder):
    """``encoder`` (conv, act, conv, act) -> ``head`` (flatten, linear); 1-D or 2-D."""

    def __init__(self, dims: int = 2, act: type[nn.Module] = nn.ReLU, size: int = 6) -> None:
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        super().__init__(
            {
                "encoder": nn.Sequential(conv(3, 5, 3, padding=1), act(), conv(5, 4, 3), act()),
                "head": nn.Sequential(nn.Flatten(), nn.Linear(4 * (size - 2) ** dims, 3)),
            }
        )
        self.input_shape = (3,) + (size,) * dims
        with torch.no_grad():  # channel 0 of the first conv dead, channel 1 always on
            self.encoder[0].bias[0] = -100.0
            self.encoder[0].bias[1] = 100.0
        self.trace_outputs(torch.zeros(1, *self.input_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def layers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every intermediate tensor, computed without the modules' hooks."""
        enc = self.encoder
        conv = F.conv2d if x.dim() == 4 else F.conv1d
        z0 = conv(x, enc[0].weight, enc[0].bias, padding=1)
        h0 = enc[1].forward(z0)
        z1 = conv(h0, enc[2].weight, enc[2].bias)
        h1 = enc[3].forward(z1)
        out = F.linear(h1.flatten(1), self.head[1].weight, self.head[1].bias)
        return {"z0": z0, "h0": h0, "z1": z1, "h1": h1, "out": out}


def batches(
    policy: ConvPolicy,
    sizes: tuple[int, ...],
    seed: int = 1,
    device: torch.device = torch.device("cpu"),
) -> list:
    """Drawn on the CPU (the same numbers on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    drawn = [
        (torch.randn(n, *policy.input_shape, generator=g), torch.randint(0, 3, (n,), generator=g))
        for n in sizes
    ]
    return [(x.to(device), a.to(device)) for x, a in drawn]


def train(policy: ConvPolicy, ctx: ComponentContext, data: list) -> dict:
    for x, a in data:
        F.cross_entropy(policy(x), a).backward()
    return StatsReporter(ctx).collect()


def per_channel(t: torch.Tensor) -> np.ndarray:
    """(B, C, *spatial) -> list of C arrays of every (sample, position) value, in numpy."""
    a = t.detach().double().cpu().numpy()
    return np.stack([a[:, c].ravel() for c in range(a.shape[1])])


def relu_reference(h: np.ndarray, batch_rows: int, tau: float = 0.025) -> dict:
    active = (h > 0).mean(1)
    mean_abs = np.abs(h).mean(1)
    score = mean_abs / (mean_abs.mean() + 1e-9)
    return {
        "active_rate": active,
        "dead_fraction": (active == 0).mean(),
        "dormant_fraction": (score <= tau).mean(),
        "rarely_active_fraction": (active < 0.05).mean(),
        "always_active_fraction": (active > 0.95).mean(),
        "zero_fraction": (h <= 0).mean(),
        "samples": batch_rows,
    }


def assert_metrics(got: dict, prefix: str, ref: dict) -> None:
    for key, value in ref.items():
        assert got[prefix + key] == pytest.approx(np.asarray(value).tolist(), rel=REL), key


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("buffer_elements", [None, 400])
def test_relu_probe_is_per_channel_on_conv_outputs(
    dims: int, buffer_elements: int | None, device: torch.device
) -> None:
    torch.manual_seed(0)
    policy = ConvPolicy(dims).to(device)
    ctx = ComponentContext()
    # the conv module itself (pre-activation), the bare ReLU after it (its layout comes from
    # the conv before it), and the encoder (ends in a ReLU after a conv)
    for name in ("encoder.0", "encoder.1", "encoder"):
        policy.attach(name, attach_relu_activation_hooks(), ctx, per_layer=False)
    if buffer_elements is not None:  # drains mid-window, several passes per drain
        ctx.model_metrics["relu"].buffer_elements = buffer_elements
    data = batches(policy, (3, 5, 2), device=device)
    got = train(policy, ctx, data)
    with torch.no_grad():
        parts = [policy.layers(x) for x, _ in data]
    cat = {k: torch.cat([p[k] for p in parts]) for k in ("z0", "h0", "h1")}
    rows = sum(x.shape[0] for x, _ in data)
    for name, tensor in (("encoder.0", "z0"), ("encoder.1", "h0"), ("encoder", "h1")):
        ref = relu_reference(per_channel(cat[tensor]), rows)
        assert len(got[f"probes/relu/{name}/active_rate"]) == cat[tensor].shape[1]
        assert_metrics(got, f"probes/relu/{name}/", ref)
    assert got["probes/relu/encoder.1/dead_fraction"] == pytest.approx(1 / 5)
    assert got["probes/relu/encoder.1/always_active_fraction"] == pytest.approx(1 / 5)


def test_channels_last_layout_keeps_the_last_axis_as_units(device: torch.device) -> None:
    torch.manual_seed(0)
    policy = ConvPolicy(2).to(device)
    ctx = ComponentContext()
    policy.attach("encoder.1", attach_relu_activation_hooks(), ctx, layout="channels_last")
    data = batches(policy, (4, 3), device=device)
    got = train(policy, ctx, data)
    with torch.no_grad():
        h0 = torch.cat([policy.layers(x)["h0"] for x, _ in data])
    rows = h0.double().reshape(-1, h0.shape[-1]).cpu().numpy().T  # W units, B*C*H rows
    ref = relu_reference(rows, rows.shape[1])
    assert_metrics(got, "probes/relu/encoder.1/", ref)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
@pytest.mark.parametrize("dims", [1, 2])
def test_saturation_probe_is_per_channel_on_conv_outputs(
    activation: str, dims: int, device: torch.device
) -> None:
    torch.manual_seed(3)
    act = nn.Tanh if activation == "tanh" else nn.Sigmoid
    policy = ConvPolicy(dims, act=act).to(device)
    ctx = ComponentContext()
    policy.attach("encoder", attach_saturated_activation_hooks(activation), ctx)
    ctx.model_metrics[f"saturation_{activation}"].buffer_elements = 300
    data = batches(policy, (4, 1, 6), device=device)
    got = train(policy, ctx, data)
    with torch.no_grad():
        parts = [policy.layers(x) for x, _ in data]
    rows = sum(x.shape[0] for x, _ in data)
    for name, tensor in (("encoder.1", "h0"), ("encoder", "h1"), ("encoder.3", "h1")):
        h = per_channel(torch.cat([p[tensor] for p in parts]))
        if activation == "tanh":
            saturated, derivative = np.abs(h) > 0.95, 1 - h**2
        else:
            saturated, derivative = (h < 0.05) | (h > 0.95), h * (1 - h)
        rate = saturated.mean(1)
        prefix = f"probes/saturation_{activation}/{name}/"
        assert_metrics(
            got,
            prefix,
            {
                "saturation_rate": rate,
                "saturated_fraction": saturated.mean(),
                "saturated_units_fraction": (rate >= 0.99).mean(),
                "mean_derivative": derivative.mean(),
                "samples": rows,
            },
        )
    # the first conv's channels 0 and 1 are pinned by their biases: saturated throughout
    assert got[f"probes/saturation_{activation}/encoder.1/saturated_units_fraction"] >= 1 / 5


def ema_reference(per_pass: list[np.ndarray], beta: float = 0.95) -> np.ndarray:
    m = np.zeros_like(per_pass[0])
    for r in per_pass:
        m = beta * m + (1 - beta) * r
    return m / (1 - beta ** len(per_pass))


@pytest.mark.parametrize("dims", [1, 2])
def test_gradient_flow_probes_are_per_channel_on_conv_outputs(
    dims: int, device: torch.device
) -> None:
    torch.manual_seed(4)
    policy = ConvPolicy(dims).to(device)
    ctx = ComponentContext()
    policy.attach("encoder", attach_gradient_flow_hooks(), ctx, backward=True)
    policy.attach("encoder", attach_relu_gradient_flow_hooks(), ctx, backward=True)
    for tracker in ctx.model_metrics.values():
        tracker.buffer_elements = 500
    data = batches(policy, (3, 7, 2, 5), device=device)
    got = train(policy, ctx, data)
    rms: dict[str, list[np.ndarray]] = {"h0": [], "h1": []}
    passed = {"z0": [], "z1": []}
    for x, a in data:
        t = policy.layers(x)
        names = ("h0", "h1", "z0", "z1")
        grads = dict(
            zip(
                names,
                torch.autograd.grad(F.cross_entropy(t["out"], a), [t[n] for n in names]),
                strict=True,
            )
        )
        for n in ("h0", "h1"):
            g = per_channel(grads[n])
            rms[n].append(np.sqrt((g**2).mean(1)))
        for n in ("z0", "z1"):
            passed[n].append(per_channel(grads[n]) != 0)
    for name, tensor in (("encoder", "h1"), ("encoder.1", "h0"), ("encoder.3", "h1")):
        ref = ema_reference(rms[tensor])
        assert got[f"probes/gradient_flow/{name}/rms"] == pytest.approx(ref.tolist(), rel=1e-5)
        assert got[f"probes/gradient_flow/{name}/passes"] == len(data)
    rates = {n: np.concatenate(p, axis=1).mean(1) for n, p in passed.items()}
    for name, tensor in (("encoder.1", "z0"), ("encoder.3", "z1")):
        prefix = f"probes/relu_gradient_flow/{name}/"
        assert got[prefix + "pass_rate"] == pytest.approx(rates[tensor].tolist(), rel=REL)
        assert got[prefix + "blocked_fraction"] == pytest.approx((rates[tensor] == 0).mean())
    both = np.concatenate([rates["z0"], rates["z1"]])
    assert got["probes/relu_gradient_flow/encoder/pass_rate"] == pytest.approx(both.tolist())
    assert got["probes/relu_gradient_flow/encoder.1/pass_rate"][0] == 0.0  # the dead channel


def test_auto_layout_follows_the_module_types() -> None:
    seq = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Dropout(), nn.Flatten(), nn.Linear(4, 2), nn.Tanh()
    )
    root = nn.Sequential(seq)
    assert output_channels_first(nn.Conv1d(2, 2, 1)) is True
    assert output_channels_first(nn.BatchNorm2d(2)) is True
    assert output_channels_first(nn.ReLU()) is None
    assert output_channels_first(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())) is True
    assert output_channels_first(seq) is False  # ends in Linear, Tanh
    lookup = root.get_submodule
    assert resolve_channels_first("auto", lookup, "0.1") is True  # ReLU after the conv
    assert resolve_channels_first("auto", lookup, "0.2") is True  # dropout after that ReLU
    assert resolve_channels_first("auto", lookup, "0.5") is False  # Tanh after the Linear
    assert resolve_channels_first("channels_first", lookup, "0.5") is True
    assert resolve_channels_first("channels_last", lookup, "0.0") is False
    assert resolve_channels_first("auto", None, "x") is False


def test_unknown_layout_is_rejected() -> None:
    for make in (
        attach_relu_activation_hooks,
        attach_gradient_flow_hooks,
        attach_relu_gradient_flow_hooks,
    ):
        with pytest.raises(ValueError, match="layout must be one of"):
            make().place(layout="nchw")
    with pytest.raises(ValueError, match="layout must be one of"):
        attach_saturated_activation_hooks("tanh").place(layout="NCHW")


def test_an_extracted_tensor_is_channels_first_only_when_asked(device: torch.device) -> None:
    torch.manual_seed(0)
    policy = ConvPolicy(1, size=7).to(device)  # encoder output (B, 4 channels, length 5)
    ctx = ComponentContext()
    pick = lambda out: out  # noqa: E731 - the extractor sees the same tensor
    policy.attach("encoder", attach_relu_activation_hooks(), ctx, extractor=pick, per_layer=False)
    policy.attach(
        "encoder.3", attach_relu_activation_hooks(), ctx, extractor=pick, layout="channels_first"
    )
    data = batches(policy, (3, 2), device=device)
    got = train(policy, ctx, data)
    with torch.no_grad():
        h1 = torch.cat([policy.layers(x)["h1"] for x, _ in data])
    last = h1.double().reshape(-1, h1.shape[-1]).cpu().numpy().T  # "auto": channels last, 5 units
    assert_metrics(got, "probes/relu/encoder/", relu_reference(last, last.shape[1]))
    assert_metrics(got, "probes/relu/encoder.3/", relu_reference(per_channel(h1), 5))
