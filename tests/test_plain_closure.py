"""The builders' contract: a closure registered directly with
``module.register_forward_hook`` / ``register_full_backward_hook`` reports the same
metrics as through ``PolicyAutoBuilder.attach``, or raises a ProbeError at its first call
naming what to call instead. Every built-in probe, forward and backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from policy_probes import ComponentContext, PolicyAutoBuilder, ProbeError, StatsReporter
from policy_probes.layers import LinearSpec, MLPSpec
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import attach_gradient_flow_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.probes.relu_gradient_flow import attach_relu_gradient_flow_hooks
from policy_probes.probes.saturation import attach_saturated_activation_hooks
from policy_probes.torch_internals import module_hook_count


class Net(PolicyAutoBuilder):
    """mlp (two hidden layers) -> act (a parameter-free activation component) -> head."""

    def __init__(self, activation: str = "relu") -> None:
        super().__init__(
            {
                "mlp": MLPSpec(in_features=5, hidden_sizes=[7, 6], activation=activation),
                "act": nn.ReLU() if activation == "relu" else nn.Tanh(),
                "head": LinearSpec(in_features=6, out_features=3),
            }
        )
        self.trace_outputs(torch.zeros(1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.mlp(x)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (9, 4, 13)
    ]


def train(policy: nn.Module, ctx: ComponentContext) -> dict:
    for x, a in batches():
        F.cross_entropy(policy(x), a).backward()
    return StatsReporter(ctx).collect()


def wired(
    make: Callable, component: str, backward: bool, activation: str, **placement: object
) -> dict:
    torch.manual_seed(0)
    policy, ctx = Net(activation), ComponentContext()
    policy.attach(component, make(), ctx, backward=backward, **placement)
    return train(policy, ctx)


def plain_policy(
    make: Callable,
    component: str,
    backward: bool,
    activation: str,
    pre_attach: bool = False,
    **placement: object,
) -> tuple[Net, ComponentContext, Callable]:
    torch.manual_seed(0)
    policy, ctx = Net(activation), ComponentContext()
    module = policy.get_component(component)
    probe = make()
    closure = probe(component, ctx, probe.place(**placement))
    if pre_attach:
        closure.attach(module)
    if backward:
        module.register_full_backward_hook(closure)
    else:
        module.register_forward_hook(closure)
    return policy, ctx, closure


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(
            np.asarray(a[key], float), np.asarray(b[key], float), rtol=1e-6, err_msg=key
        )


def tanh_saturation():
    return attach_saturated_activation_hooks("tanh")


ONE = {"per_layer": False}
# probe, builder, component, backward, activation, placement: plain registration measures
# the same
SAME = [
    ("relu", attach_relu_activation_hooks, "mlp", False, "relu", ONE),
    ("relu", attach_relu_activation_hooks, "act", False, "relu", {}),
    ("saturation", tanh_saturation, "mlp", False, "tanh", ONE),
    ("saturation", tanh_saturation, "act", False, "tanh", {}),
    ("gradient_flow", attach_gradient_flow_hooks, "mlp", True, "relu", ONE),
    ("gradient_flow", attach_gradient_flow_hooks, "act", True, "relu", {}),
    ("fisher", attach_fisher_information_hooks, "act", True, "relu", {}),
]


@pytest.mark.parametrize("probe, make, component, backward, activation, placement", SAME)
def test_plain_closure_reports_what_attach_reports(
    probe, make, component, backward, activation, placement
) -> None:
    expected = wired(make, component, backward, activation, **placement)
    assert any(k.startswith(f"probes/{probe}") for k in expected)  # the probe reported
    policy, ctx, _ = plain_policy(make, component, backward, activation, **placement)
    assert_same(train(policy, ctx), expected)


def test_plain_relu_matches_an_independent_count() -> None:
    """The plain forward closure against numpy: fraction of (sample, unit) pairs > 0."""
    policy, ctx, _ = plain_policy(attach_relu_activation_hooks, "mlp", False, "relu", **ONE)
    reference = copy.deepcopy(policy.mlp)
    metrics = train(policy, ctx)
    with torch.no_grad():
        h = np.concatenate([reference(x).numpy() for x, _ in batches()])
    active = (h > 0).mean(0)
    np.testing.assert_allclose(
        metrics["probes/relu/mlp/dead_fraction"], float((active == 0).mean())
    )
    np.testing.assert_allclose(metrics["probes/relu/mlp/active_rate"], active, rtol=1e-6)


@pytest.mark.parametrize(
    "make, component",
    [(attach_relu_gradient_flow_hooks, "mlp"), (attach_fisher_information_hooks, "mlp")],
)
def test_closure_attached_by_hand_then_registered_reports_what_attach_reports(
    make, component
) -> None:
    expected = wired(make, component, True, "relu")
    policy, ctx, _ = plain_policy(make, component, True, "relu", pre_attach=True)
    assert_same(train(policy, ctx), expected)


def first_call_error(
    make: Callable, component: str, backward: bool, activation: str = "relu"
) -> str:
    policy, ctx, closure = plain_policy(make, component, backward, activation)
    x, a = batches()[0]
    with pytest.raises(ProbeError) as info:
        F.cross_entropy(policy(x), a).backward()
    assert not any(k.startswith("probes/") for k in StatsReporter(ctx).collect())
    assert ctx.probe_errors == {}  # a set-up error, not a probe fault
    return str(info.value)


def test_relu_gradient_flow_plain_names_what_to_call() -> None:
    assert first_call_error(attach_relu_gradient_flow_hooks, "mlp", True) == (
        "probe 'relu_gradient_flow' on component 'mlp' was registered directly as a torch hook, "
        "which cannot see the nn.ReLU modules inside it: this probe reads the gradient at every "
        "ReLU's output through hooks on those modules, never the component's own gradient. "
        "Attach it with policy.attach('mlp', attach_relu_gradient_flow_hooks(), context, "
        "backward=True) (PolicyAutoBuilder; ProbeSession, TrainTool and ProbeCallback: "
        "add_training_backward_hook('mlp', attach_relu_gradient_flow_hooks())), or call "
        "closure.attach(module) once before the first forward and keep the handles it returns"
    )


def test_fisher_plain_on_parameters_names_what_to_call() -> None:
    msg = first_call_error(attach_fisher_information_hooks, "mlp", True)
    assert msg == (
        "probe 'fisher' on component 'mlp' was registered directly as a torch hook, which cannot "
        "see the layers holding its parameters (layer_0.linear.weight, layer_0.linear.bias, "
        "layer_1.linear.weight, layer_1.linear.bias): the per-parameter Fisher (trace, mean, max, "
        "dead_param_fraction) reads their inputs through hooks of their own. Attach it with "
        "policy.attach('mlp', attach_fisher_information_hooks(), context, backward=True) "
        "(PolicyAutoBuilder; ProbeSession, TrainTool and ProbeCallback: "
        "add_training_backward_hook('mlp', attach_fisher_information_hooks())), or call "
        "closure.attach(module) once before the first forward and keep the handles it returns"
    )


@pytest.mark.parametrize(
    "probe, make, backward, activation, builder",
    [
        ("relu", attach_relu_activation_hooks, False, "relu", "attach_relu_activation_hooks()"),
        (
            "saturation_tanh",
            tanh_saturation,
            False,
            "tanh",
            "attach_saturated_activation_hooks()",
        ),
        ("gradient_flow", attach_gradient_flow_hooks, True, "relu", "attach_gradient_flow_hooks()"),
    ],
)
def test_per_layer_plain_reports_the_component_and_warns_once_about_inner_layers(
    probe, make, backward, activation, builder, caplog
) -> None:
    """Issue 26: a per_layer closure registered directly reports the component as it
    did (what per_layer=False attached reports) and names, once, the inner activation
    layer it cannot see (layer_0; layer_1's output is the component's)."""
    expected = wired(make, "mlp", backward, activation, **ONE)
    assert any(k.startswith(f"probes/{probe}/mlp/") for k in expected)
    policy, ctx, _ = plain_policy(make, "mlp", backward, activation)
    with caplog.at_level("WARNING", logger="policy_probes"):
        assert_same(train(policy, ctx), expected)
    warnings = [r.getMessage() for r in caplog.records if "registered directly" in r.getMessage()]
    call = "add_training_backward_hook" if backward else "add_training_hook"
    assert warnings == [
        f"probe {probe!r} on component 'mlp' was registered directly as a torch hook, which "
        f"cannot see the activation layers inside it (layer_0) that per_layer=True reads "
        f"through hooks of their own; it reports the component's output only. Attach it with "
        f"policy.attach('mlp', {builder}, context{', backward=True' if backward else ''}) "
        f"(PolicyAutoBuilder; ProbeSession, TrainTool and ProbeCallback: {call}('mlp', "
        f"{builder})) for every layer"
    ]


def test_plain_relu_closure_on_linear_relu_reports_the_component_without_a_warning(
    caplog,
) -> None:
    """The seed's own use: ``register_forward_hook(attach_relu_activation_hooks()(name,
    ctx))`` on ``nn.Sequential(nn.Linear, nn.ReLU)``, whose only activation layer is its
    output: the component's metrics, against an independent count, and no warning."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(5, 8), nn.ReLU())
    ctx = ComponentContext()
    body.register_forward_hook(attach_relu_activation_hooks()("body", ctx))
    xs = [x for x, _ in batches()]
    with caplog.at_level("WARNING", logger="policy_probes"):
        for x in xs:
            body(x)
    metrics = StatsReporter(ctx).collect()
    assert not [r for r in caplog.records if "registered directly" in r.getMessage()]
    with torch.no_grad():
        h = torch.cat([body(x) for x in xs]).numpy()
    np.testing.assert_allclose(metrics["probes/relu/body/active_rate"], (h > 0).mean(0), rtol=1e-6)


@pytest.mark.parametrize(
    "make, backward",
    [
        (attach_relu_activation_hooks, False),
        (tanh_saturation, False),
        (attach_gradient_flow_hooks, True),
        (attach_relu_gradient_flow_hooks, True),
        (attach_fisher_information_hooks, True),
    ],
)
def test_wrong_direction_is_refused_at_the_first_call(make, backward) -> None:
    """A backward probe registered as a forward hook and the other way round."""
    msg = first_call_error(make, "act", not backward)
    want = (
        "module.register_full_backward_hook(closure)"
        if backward
        else "module.register_forward_hook(closure)"
    )
    assert f"probe but was registered as a {'forward' if backward else 'backward'} hook" in msg
    assert f"register it with {want}, or attach it with policy.attach('act', " in msg


def test_plain_backward_refuses_a_row_mask_and_an_extractor() -> None:
    policy, ctx, _ = plain_policy(attach_gradient_flow_hooks, "mlp", True, "relu", **ONE)
    x, a = batches()[0]
    ctx.row_mask = torch.ones(x.shape[0], dtype=torch.bool)
    with pytest.raises(ProbeError, match="a row mask is set, and a full backward hook cannot tell"):
        F.cross_entropy(policy(x), a).backward()
    policy, ctx, _ = plain_policy(
        attach_gradient_flow_hooks, "mlp", True, "relu", per_layer=False, extractor=lambda o: o
    )
    with pytest.raises(ProbeError, match="has an extractor; a full backward hook receives"):
        F.cross_entropy(policy(x), a).backward()


def test_a_custom_probe_whose_attach_hooks_submodules_is_refused_plain() -> None:
    """A user's probe that hooks submodules in attach() but does not say so in
    plain_call_gaps(): the late hooks are removed again and the first call refuses."""
    from policy_probes import Probe

    seen: list[torch.Tensor] = []

    class FirstLayer(Probe):
        name = "first_layer"

        def record(self, obs, module: nn.Module, output: torch.Tensor, weight) -> None:
            seen.append(output)

        def attach(self, obs, module: nn.Module) -> list:
            return [module.layer_0.register_forward_hook(lambda *_: None)]

    policy, ctx = Net(), ComponentContext()
    policy.mlp.register_forward_hook(FirstLayer()("mlp", ctx))
    with pytest.raises(ProbeError, match="which cannot see the submodules its attach\\(\\) hooks"):
        policy(torch.randn(2, 5))
    assert seen == [] and module_hook_count(policy.mlp.layer_0) == 0
