"""Per-layer keys: every activation layer inside a probed component, each against an
independent computation on that layer's own output; per_layer=False gives the old keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy
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
from policy_probes.probes.per_layer import activation_layers

REL = 1e-6


def data(
    sizes: tuple[int, ...] = (9, 4, 13),
    features: int = 5,
    seed: int = 1,
    device: torch.device | str = "cpu",
) -> list:
    """Minibatches drawn on the CPU (the same values on every device), moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    batches = [
        (torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g))
        for n in sizes
    ]
    return [(x.to(device), a.to(device)) for x, a in batches]


def train(policy: nn.Module, ctx: ComponentContext, batches: list) -> dict:
    for x, a in batches:
        F.cross_entropy(policy(x), a).backward()
    return StatsReporter(ctx).collect()


def mlp_layers(policy: TinyPolicy, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pre- and post-activations of both hidden layers and the logits, written out."""
    mlp = policy.actor_mlp
    act = torch.relu if isinstance(mlp.layer_0.act, nn.ReLU) else torch.tanh
    z0 = F.linear(x, mlp.layer_0.linear.weight, mlp.layer_0.linear.bias)
    h0 = act(z0)
    z1 = F.linear(h0, mlp.layer_1.linear.weight, mlp.layer_1.linear.bias)
    h1 = act(z1)
    out = F.linear(h1, policy.actor_head.weight, policy.actor_head.bias)
    return {"z0": z0, "h0": h0, "z1": z1, "h1": h1, "out": out}


def relu_reference(h: np.ndarray, tau: float = 0.025) -> dict:
    """(units, samples) numpy array -> the relu probe's metrics."""
    active = (h > 0).mean(1)
    mean_abs = np.abs(h).mean(1)
    score = mean_abs / (mean_abs.mean() + 1e-9)
    return {
        "active_rate": active.tolist(),
        "dead_fraction": (active == 0).mean(),
        "dormant_fraction": (score <= tau).mean(),
        "zero_fraction": (h <= 0).mean(),
        "samples": h.shape[1],
    }


def ema_rms(grads: list[np.ndarray], beta: float = 0.95) -> list[float]:
    m = np.zeros(grads[0].shape[0])
    for g in grads:
        m = beta * m + (1 - beta) * np.sqrt((g**2).mean(1))
    return (m / (1 - beta ** len(grads))).tolist()


def units(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy().T


def check(got: dict, prefix: str, ref: dict) -> None:
    for key, value in ref.items():
        assert got[prefix + key] == pytest.approx(value, rel=REL), prefix + key


def test_every_hidden_layer_of_an_mlp_is_reported_against_its_own_output(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy()
    with torch.no_grad():  # a dead unit in layer 0 only
        policy.actor_mlp.layer_0.linear.bias[2] = -100.0
    policy.to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    policy.attach("actor_mlp", attach_gradient_flow_hooks(), ctx, backward=True)
    policy.attach("actor_mlp", attach_relu_gradient_flow_hooks(), ctx, backward=True)
    batches = data(device=device)
    got = train(policy, ctx, batches)
    fwd = {"h0": [], "h1": []}
    grads: dict[str, list[np.ndarray]] = {"h0": [], "h1": [], "z0": [], "z1": []}
    for x, a in batches:
        t = mlp_layers(policy, x)
        names = ("h0", "h1", "z0", "z1")
        for n, g in zip(
            names,
            torch.autograd.grad(F.cross_entropy(t["out"], a), [t[n] for n in names]),
            strict=True,
        ):
            grads[n].append(units(g))
        for n in fwd:
            fwd[n].append(units(t[n]))
    layers = {"actor_mlp.layer_0": ("h0", "z0"), "actor_mlp.layer_1": ("h1", "z1")}
    layers["actor_mlp"] = layers["actor_mlp.layer_1"]  # the component's output is layer_1's
    for name, (h, z) in layers.items():
        check(got, f"probes/relu/{name}/", relu_reference(np.concatenate(fwd[h], axis=1)))
        assert got[f"probes/gradient_flow/{name}/rms"] == pytest.approx(ema_rms(grads[h]), rel=1e-5)
        if name != "actor_mlp":
            rate = (np.concatenate(grads[z], axis=1) != 0).mean(1)
            check(
                got,
                f"probes/relu_gradient_flow/{name}/",
                {"pass_rate": rate.tolist(), "blocked_fraction": (rate == 0).mean()},
            )
    assert got["probes/relu/actor_mlp.layer_0/dead_fraction"] == pytest.approx(1 / 7)
    # a HiddenLayer and its .act are one layer: no key for the activation module itself
    assert not [k for k in got if ".act" in k]
    assert {k.split("/")[2] for k in got if k.startswith("probes/relu/")} == {
        "actor_mlp",
        "actor_mlp.layer_0",
        "actor_mlp.layer_1",
    }


def test_per_layer_false_reproduces_the_component_keys_and_values(device: torch.device) -> None:
    def run(per_layer: bool) -> dict:
        torch.manual_seed(0)
        policy = TinyPolicy().to(device)
        ctx = ComponentContext()
        policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx, per_layer=per_layer)
        for make in (attach_gradient_flow_hooks, attach_relu_gradient_flow_hooks):
            policy.attach("actor_mlp", make(), ctx, backward=True, per_layer=per_layer)
        return train(policy, ctx, data(device=device))

    old, new = run(False), run(True)
    component_keys = {
        f"probes/relu/actor_mlp/{m}"
        for m in (
            "active_rate",
            "dead_fraction",
            "dormant_fraction",
            "rarely_active_fraction",
            "always_active_fraction",
            "zero_fraction",
            "nonfinite_fraction",
            "samples",
            "active_rate_se",
            "zero_fraction_se",
            "dormant_fraction_tau_0",
            "dormant_fraction_tau_0.025",
            "dormant_fraction_tau_0.1",
        )
    }
    component_keys |= {
        f"probes/gradient_flow/actor_mlp/{m}"
        for m in ("rms", "mean", "min", "blocked_fraction", "passes", "nonfinite_fraction")
    }
    component_keys |= {
        f"probes/relu_gradient_flow/actor_mlp/{m}"
        for m in ("pass_rate", "mean_pass_rate", "blocked_fraction", "nonfinite_fraction")
    }
    component_keys |= {
        f"probes/relu_gradient_flow/actor_mlp/layer_{i}.act.{m}"
        for i in (0, 1)
        for m in ("pass_rate", "blocked_fraction")
    }
    assert set(old) == component_keys
    for key in component_keys - {k for k in component_keys if ".act." in k}:
        assert new[key] == old[key], key  # the same computation on the same rows
    assert not [k for k in new if ".act." in k]  # per layer: actor_mlp.layer_<i>/... instead
    assert (
        new["probes/relu_gradient_flow/actor_mlp.layer_0/pass_rate"]
        == old["probes/relu_gradient_flow/actor_mlp/layer_0.act.pass_rate"]
    )


def test_saturation_reads_only_layers_of_its_activation(device: torch.device) -> None:
    torch.manual_seed(0)
    tanh_policy = TinyPolicy(activation="tanh").to(device)
    ctx = ComponentContext()
    tanh_policy.attach("actor_mlp", attach_saturated_activation_hooks("tanh", threshold=0.6), ctx)
    batches = data(device=device)
    got = train(tanh_policy, ctx, batches)
    with torch.no_grad():
        outs = [mlp_layers(tanh_policy, x) for x, _ in batches]
    for name, h in (("actor_mlp.layer_0", "h0"), ("actor_mlp.layer_1", "h1")):
        v = np.concatenate([units(o[h]) for o in outs], axis=1)
        saturated = np.abs(v) > 0.6
        check(
            got,
            f"probes/saturation_tanh/{name}/",
            {
                "saturation_rate": saturated.mean(1).tolist(),
                "saturated_fraction": saturated.mean(),
                "mean_derivative": (1 - v**2).mean(),
                "samples": v.shape[1],
            },
        )
    relu_policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    relu_policy.attach("actor_mlp", attach_saturated_activation_hooks("tanh"), ctx)
    got = train(relu_policy, ctx, batches)
    assert {k.split("/")[2] for k in got} == {"actor_mlp"}  # no tanh layer inside


def test_a_plain_sequential_conv_encoder_reports_each_activation(device: torch.device) -> None:
    torch.manual_seed(2)
    encoder = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 3, 3), nn.ReLU(), nn.Flatten()
    )
    model = nn.Sequential(encoder, nn.Linear(3 * 2 * 2, 6), nn.ReLU(), nn.Linear(6, 3))
    model.to(device)
    policy = PolicyAutoBuilder.wrap(model, {"features": "0", "trunk": model})
    ctx = ComponentContext()
    policy.attach("features", attach_relu_activation_hooks(), ctx)
    policy.attach("trunk", attach_relu_activation_hooks(), ctx)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(n, 2, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
        for n in (5, 3)
    ]
    batches = [(x.to(device), a.to(device)) for x, a in batches]
    got = train(policy, ctx, batches)
    with torch.no_grad():
        z0 = torch.cat([encoder[0](x) for x, _ in batches])
        h0 = torch.relu(z0)
        h1 = torch.relu(encoder[2](h0))
        h2 = torch.relu(model[1](h1.flatten(1)))

    def channels(t: torch.Tensor) -> np.ndarray:
        return np.stack([t[:, c].cpu().double().numpy().ravel() for c in range(t.shape[1])])

    rows = 8
    for name, h in (("features.1", h0), ("features.3", h1), ("trunk.0.1", h0), ("trunk.0.3", h1)):
        ref = relu_reference(channels(h))
        ref["samples"] = rows  # batch rows; rates are over (sample, position) elements
        check(got, f"probes/relu/{name}/", ref)
    check(got, "probes/relu/trunk.2/", relu_reference(units(h2)))
    check(got, "probes/relu/features/", relu_reference(units(h1.flatten(1))))  # Flatten: dense


def test_a_layer_probed_on_its_own_keeps_its_registration(device: torch.device) -> None:
    torch.manual_seed(0)
    for first in ("component", "layer"):
        policy = TinyPolicy().to(device)
        ctx = ComponentContext()
        steps = [
            ("actor_mlp", attach_relu_activation_hooks()),
            ("actor_mlp.layer_0", attach_relu_activation_hooks(tau=0.9)),
        ]
        for name, builder in steps if first == "component" else steps[::-1]:
            policy.attach(name, builder, ctx)
        tracker = ctx.model_metrics["relu"]
        assert tracker.settings["actor_mlp.layer_0"]["tau"] == 0.9
        assert tracker.settings["actor_mlp.layer_1"]["tau"] == 0.025
        batches = data(device=device)
        got = train(policy, ctx, batches)
        with torch.no_grad():
            h0 = np.concatenate([units(mlp_layers(policy, x)["h0"]) for x, _ in batches], axis=1)
        check(got, "probes/relu/actor_mlp.layer_0/", relu_reference(h0, tau=0.9))  # counted once


def test_the_component_and_its_last_layer_share_one_materialisation(device: torch.device) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    train(policy, ctx, data((6,), device=device))  # collect() drained the window
    tracker = ctx.model_metrics["relu"]
    stored = {name for (name, _), buf in tracker.buffers.items() if buf.storage}
    # three buffers, two tensors: the component's output is layer_1's, materialised once
    assert len(tracker.buffers) == 3
    assert len(stored) == 2 and "actor_mlp.layer_0" in stored


def test_activation_layers_are_hidden_layers_or_activation_modules() -> None:
    policy = TinyPolicy()
    assert [layer.name for layer in activation_layers(policy.actor_mlp)] == ["layer_0", "layer_1"]
    assert activation_layers(policy.actor_mlp.layer_0) == []  # the component is the layer
    seq = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Sequential(nn.Linear(2, 2), nn.SiLU()))
    assert [layer.name for layer in activation_layers(seq)] == ["1", "2.1"]


class SharedReLUBody(nn.Module):
    """One nn.ReLU instance applied after both Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.act = nn.Linear(5, 4), nn.Linear(4, 4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.l1(self.act(self.l0(x))))


def test_an_activation_module_run_twice_per_forward_is_refused_not_mixed(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SharedReLUBody(), nn.Linear(4, 3)).to(device)
    policy = PolicyAutoBuilder.wrap(model, {"body": "0"})
    ctx = ComponentContext()
    policy.attach("body", attach_relu_activation_hooks(), ctx)
    got = train(policy, ctx, data(device=device))
    assert "runs more than once" in ctx.probe_errors["relu/body.act"]
    assert got["probes/errors/relu/body.act"] == 1.0
    assert not [k for k in got if k.startswith("probes/relu/body.act/")]  # nothing mixed
    assert got["probes/relu/body/samples"] == 9 + 4 + 13  # the component itself goes on


def test_layer_module_called_outside_the_component_is_not_read(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    """A layer's own call outside the component's forward (a reference computation, a
    second network sharing the module) is neither recorded nor taken for reuse."""
    tiny_policy.to(device)
    ctx = ComponentContext(strict=True)
    tiny_policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    batches = data(device=device)
    for x, a in batches:
        F.cross_entropy(tiny_policy(x), a).backward()
        outside = torch.randn(50, 5).to(device)
        tiny_policy.actor_mlp.layer_0(outside)  # outside actor_mlp's forward
    got = StatsReporter(ctx).collect()
    with torch.no_grad():
        h0 = torch.cat([mlp_layers(tiny_policy, x)["h0"] for x, _ in batches])
    check(got, "probes/relu/actor_mlp.layer_0/", relu_reference(units(h0)))
    assert not ctx.probe_errors


def test_conv_layer_blocks_are_one_layer_each_read_per_channel(device: torch.device) -> None:
    """A ConvLayer (``act(conv(x))``, the conv counterpart of HiddenLayer) is one layer,
    reported under its own name like a HiddenLayer, never again as ``<block>.act``."""
    from policy_probes.layers import ConvLayer

    torch.manual_seed(3)
    enc = nn.Sequential(ConvLayer(2, 4, 3, 1, "relu"), ConvLayer(4, 5, 2, 2, "relu")).to(device)
    policy = PolicyAutoBuilder.wrap(nn.Sequential(enc, nn.Flatten()), {"enc": "0"})
    ctx = ComponentContext(strict=True)
    policy.attach("enc", attach_relu_activation_hooks(), ctx)
    xs = [torch.randn(n, 2, 9, 9).to(device) for n in (3, 5)]
    outs: dict[str, list[torch.Tensor]] = {"0": [], "1": []}
    for x in xs:
        h0 = enc[0](x)  # a reference pass outside the component is not recorded
        outs["0"].append(h0.detach())
        outs["1"].append(enc[1](h0).detach())
        policy(x)
    got = StatsReporter(ctx).collect()
    assert not any(k.startswith("probes/relu/enc.0.act/") for k in got)
    for name, hs in outs.items():
        h = torch.cat(hs)  # (B, C, H, W) -> channels x (sample, position) elements
        per_channel = h.movedim(1, 0).reshape(h.shape[1], -1).cpu().double().numpy()
        ref = relu_reference(per_channel)
        ref["samples"] = h.shape[0]
        check(got, f"probes/relu/enc.{name}/", ref)
