"""PolicyAutoBuilder names and registration rules, builder contract, cleanup, faults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_BACKWARD, ALL_FORWARD, TinyPolicy, hook_counts
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeError,
    ProbeSettings,
    Run,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.layers import MLP
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig
from trainers import TrainTool


class DictBody(nn.Module):
    """A component that returns a mapping, as many real policies do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(4, [6], "relu")

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"features": self.net(x), "aux": x.sum(-1)}


class DictPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = DictBody()
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)["features"])


def test_dotted_names_and_globs(tiny_policy: TinyPolicy) -> None:
    names = tiny_policy.component_names()
    assert names[:4] == [
        "actor_mlp",
        "actor_mlp.layer_0",
        "actor_mlp.layer_0.linear",
        "actor_mlp.layer_0.act",
    ]
    assert tiny_policy.resolve("actor_mlp.*") == ["actor_mlp.layer_0", "actor_mlp.layer_1"]
    assert tiny_policy.resolve("actor_mlp.**.linear") == [
        "actor_mlp.layer_0.linear",
        "actor_mlp.layer_1.linear",
    ]
    assert tiny_policy.resolve("actor_*") == ["actor_mlp", "actor_head"]
    assert list(tiny_policy.components) == ["actor_mlp", "actor_head"]
    assert tiny_policy.get_component("actor_mlp.layer_1.act") is tiny_policy.actor_mlp.layer_1.act


def test_unknown_names_list_available_and_closest(tiny_policy: TinyPolicy) -> None:
    with pytest.raises(
        KeyError,
        match=r"unknown component 'actor_mpl'.*Closest: actor_mlp.*Available components: actor_mlp",
    ):
        tiny_policy.register_component_hook_rule(component_name="actor_mpl", hook=lambda *a: None)
    with pytest.raises(KeyError, match=r"unknown glob pattern 'critic_\*'.*Available components"):
        tiny_policy.attach("critic_*", attach_relu_activation_hooks(), ComponentContext())


def test_builder_contract_errors(tiny_policy: TinyPolicy) -> None:
    ctx = ComponentContext()
    with pytest.raises(
        TypeError,
        match=r"must be callable as \(component_name, context\).*attach_relu_activation_hooks\(\)",
    ):
        tiny_policy.attach("actor_mlp", attach_relu_activation_hooks, ctx)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a callable hook or None"):
        tiny_policy.attach("actor_mlp", lambda name, c: 42, ctx)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must be callable"):
        tiny_policy.attach("actor_mlp", "relu", ctx)  # type: ignore[arg-type]


def test_second_registration_of_a_component_returns_none(tiny_policy: TinyPolicy) -> None:
    ctx = ComponentContext()
    builder = attach_relu_activation_hooks()
    first = builder("actor_mlp", ctx)
    assert callable(first)
    assert builder("actor_mlp", ctx) is None
    assert attach_relu_activation_hooks()("actor_mlp", ctx) is None  # same tracker, same component
    assert len(tiny_policy.attach("actor_mlp", builder, ctx)) == 0


def test_backward_probes_fire_on_tensor_output(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    ctx = ComponentContext()
    hooks = []
    for make in ALL_BACKWARD:
        hook = make()("actor_mlp", ctx)
        hooks.append(hook)
        tiny_policy.register_component_backward_hook_rule(component_name="actor_mlp", hook=hook)
    for _ in range(3):
        x, a = torch.randn(8, 5).to(device), torch.randint(0, 3, (8,)).to(device)
        F.cross_entropy(tiny_policy(x), a).backward()
    # fisher and gradient_flow: one call per backward; relu_gradient_flow: one per ReLU per backward
    assert [h.calls for h in hooks] == [3, 3, 6]
    got = StatsReporter(ctx).collect()
    assert got["probes/fisher/actor_mlp/samples"] == 24
    assert got["probes/gradient_flow/actor_mlp/passes"] == 3


def test_backward_probe_on_mapping_output_fails_at_attach_without_extractor() -> None:
    model = PolicyAutoBuilder.wrap(DictPolicy(), example_inputs=(torch.zeros(1, 4),))
    assert model.output_kind("body") == "mapping"
    with pytest.raises(ProbeError, match="returns a mapping, not a tensor.*extractor"):
        model.attach("body", attach_fisher_information_hooks(), ComponentContext(), backward=True)


def test_backward_probe_on_untraced_mapping_output_fails_on_first_forward(
    device: torch.device,
) -> None:
    model = PolicyAutoBuilder.wrap(DictPolicy().to(device))
    assert model.output_kind("body") == "unknown"
    ctx = ComponentContext()
    model.attach("body", attach_gradient_flow_hooks(), ctx, backward=True)
    x = torch.zeros(2, 4).to(device)
    assert model(x).shape == (2, 2)  # the probe fault rule: training goes on
    assert "cannot fire: it returned a mapping" in ctx.probe_errors["gradient_flow/body"]
    model.remove_hooks()
    model.attach("body", attach_gradient_flow_hooks(), ComponentContext(strict=True), backward=True)
    with pytest.raises(ProbeError, match="cannot fire: it returned a mapping"):
        model(x)


def test_probes_read_mapping_outputs_through_an_extractor(device: torch.device) -> None:
    torch.manual_seed(0)
    policy = DictPolicy().to(device)
    model = PolicyAutoBuilder.wrap(policy, example_inputs=(torch.zeros(1, 4).to(device),))
    ctx = ComponentContext()
    pick = lambda out: out["features"]  # noqa: E731
    model.attach("body", attach_relu_activation_hooks(), ctx, extractor=pick)
    model.attach("body", attach_gradient_flow_hooks(), ctx, backward=True, extractor=pick)
    fisher = attach_fisher_information_hooks()
    model.attach("body", fisher, ctx, backward=True, extractor=pick)
    x, a = torch.randn(10, 4), torch.randint(0, 2, (10,))
    x, a = x.to(device), a.to(device)
    F.cross_entropy(model(x), a).backward()
    got = StatsReporter(ctx).collect()
    model.remove_hooks()
    h = policy.body(x)["features"].detach().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(policy.head(h), a), h)
    h, g = h.cpu(), g.cpu()
    assert got["probes/relu/body/active_rate"] == pytest.approx((h > 0).double().mean(0).tolist())
    assert got["probes/gradient_flow/body/rms"] == pytest.approx(
        g.double().pow(2).mean(0).sqrt().tolist(), rel=1e-5
    )
    assert got["probes/fisher/body/unit"] == pytest.approx(
        (10 * g.double()).pow(2).mean(0).tolist(), rel=1e-5
    )
    assert got["probes/fisher/body/trace"] > 0  # the inner Linear layers are covered too


def test_extractor_that_returns_no_tensor_disables_the_probe_with_a_clear_error(
    device: torch.device,
) -> None:
    model = PolicyAutoBuilder.wrap(DictPolicy().to(device))
    ctx = ComponentContext()
    model.attach(
        "body", attach_relu_activation_hooks(), ctx, extractor=lambda out: out["aux"].tolist()
    )
    model(torch.randn(3, 4).to(device))
    assert (
        "returned a list of 3 items; it must return a torch.Tensor" in ctx.probe_errors["relu/body"]
    )
    assert StatsReporter(ctx).collect()["probes/errors/relu/body"] == 1.0
    ctx.strict = True
    model.remove_hooks()
    ctx2 = ComponentContext(strict=True)
    model.attach(
        "body", attach_relu_activation_hooks(), ctx2, extractor=lambda out: out["aux"].tolist()
    )
    with pytest.raises(ProbeError, match="must return a torch.Tensor"):
        model(torch.randn(3, 4).to(device))


def test_forward_probe_on_mapping_without_extractor_names_the_fix(device: torch.device) -> None:
    model = PolicyAutoBuilder.wrap(DictPolicy().to(device))
    ctx = ComponentContext()
    model.attach("body", attach_relu_activation_hooks(), ctx)
    out = model(torch.randn(3, 4).to(device))  # training goes on
    assert out.shape == (3, 2)
    assert "pass extractor=" in ctx.probe_errors["relu/body"]


def test_inplace_relu_under_backward_probe_is_rejected() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    model = PolicyAutoBuilder.wrap(net, {"body": net})
    with pytest.raises(ProbeError, match=r"body\.1 is ReLU\(inplace=True\).*inplace=False"):
        model.attach("body", attach_gradient_flow_hooks(), ComponentContext(), backward=True)


def test_wrap_with_dotted_paths_and_discovery() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = PolicyAutoBuilder.wrap(net, {"trunk": "1", "inp": net[0]})
    assert model.components["trunk"] is net[1]
    assert "trunk.1" in model.component_names()
    discovered = PolicyAutoBuilder.wrap(net)
    assert list(discovered.components) == ["0", "1"]
    with pytest.raises(KeyError, match=r"no submodule 'nope'.*\['0', '1', '1.0', '1.1'\]"):
        PolicyAutoBuilder.wrap(net, {"x": "nope"})
    with pytest.raises(TypeError, match="must be a submodule"):
        PolicyAutoBuilder.wrap(net, {"x": nn.Linear(1, 1)})
    # wrapping changes nothing: the same outputs
    x = torch.randn(2, 3)
    assert torch.equal(model(x), net(x))


def test_every_handle_removed_and_no_graph_kept(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    before = hook_counts(tiny_policy)
    ctx = ComponentContext()
    for make in ALL_FORWARD:
        tiny_policy.attach("actor_mlp", make(), ctx)
        tiny_policy.attach("actor_mlp.*", make(), ctx)
    for make in ALL_BACKWARD:
        tiny_policy.attach("actor_mlp", make(), ctx, backward=True)
    assert hook_counts(tiny_policy) > before
    for _ in range(2):
        x, a = torch.randn(6, 5).to(device), torch.randint(0, 3, (6,)).to(device)
        F.cross_entropy(tiny_policy(x), a).backward()
    # no tracker holds a tensor that requires grad or references an autograd graph
    for tracker in ctx.model_metrics.values():
        assert not tracker.holds_graph()
        for st in tracker.state.values():
            for t in st.values():
                assert t.grad_fn is None and not t.requires_grad
    tiny_policy.remove_hooks()
    assert hook_counts(tiny_policy) == before == 0
    assert tiny_policy.hook_handles == []


def test_one_handle_removes_its_submodule_hooks(tiny_policy: TinyPolicy) -> None:
    (handle,) = tiny_policy.attach(
        "actor_mlp", attach_fisher_information_hooks(), ComponentContext(), backward=True
    )
    assert hook_counts(tiny_policy) == 3  # the component hook and one per nn.Linear inside
    handle.remove()
    assert hook_counts(tiny_policy) == 0


def test_unsupported_activation_name_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"unsupported activation 'rellu'.*Did you mean 'relu'"):
        TinyPolicy(activation="rellu")


def test_probe_attached_in_the_wrong_direction_is_rejected(tiny_policy: TinyPolicy) -> None:
    ctx = ComponentContext()
    with pytest.raises(
        TypeError, match="'gradient_flow' probe is a backward probe.*add_training_hook"
    ):
        tiny_policy.attach("actor_mlp", attach_gradient_flow_hooks(), ctx, backward=False)
    with pytest.raises(TypeError, match="'relu' probe is a forward probe.*add_training_hook"):
        tiny_policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx, backward=True)
    # the failed attempts registered nothing: the right calls still attach
    assert (
        len(tiny_policy.attach("actor_mlp", attach_gradient_flow_hooks(), ctx, backward=True)) == 1
    )
    assert len(tiny_policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)) == 1


def test_a_probe_is_placed_by_its_own_direction(tmp_path, device: torch.device) -> None:
    """add_training_hook takes a backward probe as such (ProbeSession and TrainTool);
    add_training_backward_hook still refuses a forward probe."""
    policy = TinyPolicy().to(device)
    with ProbeSession(
        policy, run=Run(tmp_path / "run"), probing=ProbeSettings(sinks=SinksConfig(console=False))
    ) as s:
        s.add_training_hook("actor_mlp", attach_gradient_flow_hooks(), per_layer=False)
        with pytest.raises(TypeError, match="'relu' probe is a forward probe"):
            s.add_training_backward_hook("actor_mlp", attach_relu_activation_hooks())
        s.set_phase("train")
        out = policy.actor_mlp(torch.randn(8, 5).to(device))
        out.retain_grad()
        policy.actor_head(out).square().sum().backward()
        record = s.epoch_end(step=8)
    # one pass: the bias-corrected EMA of the per-unit gradient RMS is that pass's RMS
    expected = out.grad.square().mean(0).sqrt()
    assert record["probes/gradient_flow/actor_mlp/rms"] == pytest.approx(expected.cpu().tolist())
    tool = TrainTool(device=device.type)
    tool.add_training_hook("actor_mlp", attach_gradient_flow_hooks())
    assert tool.check_setup() == {"actor_mlp": ["actor_mlp"]}


def test_a_failed_attach_can_be_retried_with_a_fixed_builder() -> None:
    model = PolicyAutoBuilder.wrap(DictPolicy(), example_inputs=(torch.zeros(1, 4),))
    ctx = ComponentContext()
    with pytest.raises(ProbeError):
        model.attach("body", attach_gradient_flow_hooks(), ctx, backward=True)
    handles = model.attach(
        "body", attach_gradient_flow_hooks(), ctx, backward=True, extractor=lambda o: o["features"]
    )
    assert len(handles) == 1
    assert isinstance(handles[0], torch.utils.hooks.RemovableHandle)


def test_a_component_that_changes_width_loses_the_window_but_not_the_run(
    device: torch.device,
) -> None:
    model = PolicyAutoBuilder.wrap(nn.Sequential(nn.Identity()), {"feat": "0"})
    ctx = ComponentContext()
    model.attach("feat", attach_relu_activation_hooks(), ctx)
    model(torch.randn(3, 4).to(device))
    model(torch.randn(3, 5).to(device))
    metrics = StatsReporter(ctx).collect()
    assert metrics["probes/errors/relu/feat"] == 1.0
    assert "changed shape within a window" in ctx.probe_errors["relu/feat"]
    model(torch.randn(6, 5).to(device))  # the next window works again
    assert StatsReporter(ctx).collect()["probes/relu/feat/samples"] == 6
    strict = ComponentContext(strict=True)
    model.remove_hooks()
    model.attach("feat", attach_relu_activation_hooks(), strict)
    model(torch.randn(3, 4).to(device))
    model(torch.randn(3, 5).to(device))
    with pytest.raises(RuntimeError, match="changed shape"):
        StatsReporter(strict).collect()


def test_spec_as_dict_and_bad_spec() -> None:
    model = PolicyAutoBuilder(
        {"mlp": {"kind": "mlp", "in_features": 3, "hidden_sizes": [4], "activation": "tanh"}}
    )
    assert model.component_names() == [
        "mlp",
        "mlp.layer_0",
        "mlp.layer_0.linear",
        "mlp.layer_0.act",
    ]
    with pytest.raises(
        TypeError, match="component 'x' must be an nn.Module, an MLPSpec/LinearSpec or a dict"
    ):
        PolicyAutoBuilder({"x": 3})


def test_sigmoid_threshold_must_exceed_one_half() -> None:
    with pytest.raises(ValueError, match=r"sigmoid saturation must lie in \(0.5, 1\)"):
        attach_saturated_activation_hooks("sigmoid", threshold=0.3)


def test_tracing_outputs_leaves_rng_and_modes_untouched(device: torch.device) -> None:
    class Sampling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x) + torch.randn_like(x)

    net = Sampling().to(device)
    x = (torch.ones(4, 3) * 5).to(device)
    # the CPU stream, and the device's (the one the forward's randn_like draws from)
    torch.manual_seed(0)
    expected = torch.rand(1), torch.rand(1, device=device)
    torch.manual_seed(0)
    PolicyAutoBuilder.wrap(net, {"norm": "norm"}, example_inputs=(x,))
    drawn = torch.rand(1), torch.rand(1, device=device)
    assert torch.equal(drawn[0], expected[0])  # the forward's randn_like drew from a fork
    assert torch.equal(drawn[1], expected[1])
    assert net.training
    assert torch.equal(net.norm.running_mean.cpu(), torch.zeros(3))  # traced in eval mode


def test_probes_install_their_hooks_only_in_phases_they_record(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    ctx = ComponentContext()
    attach = tiny_policy.attach
    attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    attach("actor_mlp", attach_fisher_information_hooks(), ctx, backward=True)
    attach("actor_mlp.layer_0", attach_relu_activation_hooks(), ctx, phases=("rollout",))
    # train: the relu hooks (the component, and per layer a forward pre-hook and a
    # forward hook on it and layer_1's: the explicit rollout probe took layer_0 over) and
    # fisher's (1 component tap + 2 Linear taps); the rollout probe is off
    assert hook_counts(tiny_policy) == 7
    assert tiny_policy.hooks_installed()
    ctx.phase = "rollout"
    assert hook_counts(tiny_policy) == 1  # only the rollout probe's
    ctx.phase = "eval"
    assert hook_counts(tiny_policy) == 0
    assert not tiny_policy.hooks_installed()
    ctx.phase = "train"
    assert hook_counts(tiny_policy) == 7
    x, a = torch.randn(9, 5).to(device), torch.randint(0, 3, (9,)).to(device)
    F.cross_entropy(tiny_policy(x), a).backward()
    got = StatsReporter(ctx).collect()
    assert got["probes/relu/actor_mlp/samples"] == 9
    assert got["probes/fisher/actor_mlp/samples"] == 9
    assert "probes/relu/actor_mlp.layer_0/samples" not in got  # never armed in train
    tiny_policy.remove_hooks()
    ctx.phase = "rollout"  # a removed probe never comes back
    assert hook_counts(tiny_policy) == 0


def test_a_plain_function_hook_that_raises_is_disabled_not_fatal(
    tiny_policy: TinyPolicy, device: torch.device
) -> None:
    tiny_policy.to(device)
    calls = []

    def build(component: str, context: ComponentContext):
        def hook(module, inputs, output):
            calls.append(component)
            raise RuntimeError("unexpected output layout")

        return hook

    ctx = ComponentContext()
    tiny_policy.attach("actor_mlp", build, ctx)
    for _ in range(3):
        assert tiny_policy(torch.randn(4, 5).to(device)).shape == (4, 3)  # the forward goes on
    assert calls == ["actor_mlp"]  # disabled after the first fault
    assert "unexpected output layout" in ctx.probe_errors["build/actor_mlp"]
    assert StatsReporter(ctx).collect()["probes/errors/build/actor_mlp"] == 1.0
    tiny_policy.remove_hooks()
    tiny_policy.attach("actor_mlp", build, ComponentContext(strict=True))
    with pytest.raises(RuntimeError, match="unexpected output layout"):
        tiny_policy(torch.randn(4, 5).to(device))
