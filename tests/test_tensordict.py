"""TensorDict modules as components: in-place check by type, key / nested-key / index
extractors, and short errors for TensorDict outputs. Metrics are checked against
computations from plain torch (activations and gradients recomputed outside the probes,
per-sample gradients with torch.func)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeError,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.outputs import describe_output as describe_type

OBS, HIDDEN, ACT = 4, 6, 3


class Policy(nn.Module):
    """A TensorDictModule body (default ``inplace=True``) that writes ``"hidden"`` and a
    plain head on top of it."""

    def __init__(self, out_key: str | tuple[str, ...] = "hidden") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(OBS, 8), nn.ReLU(), nn.Linear(8, HIDDEN), nn.ReLU())
        self.body = TensorDictModule(self.net, in_keys=["observation"], out_keys=[out_key])
        self.head = nn.Linear(HIDDEN, ACT)
        self.out_key = out_key

    def forward(self, td: TensorDict) -> torch.Tensor:
        return self.head(self.body(td).get(self.out_key))


def batch(n: int = 12, seed: int = 0) -> tuple[TensorDict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, OBS, generator=g)
    td = TensorDict({"observation": obs, "extra": {"mask": torch.ones(n, 1)}}, batch_size=[n])
    return td, torch.randint(0, ACT, (n,), generator=g)


def relu_reference(h: torch.Tensor) -> tuple[list[float], float]:
    active = (h > 0).double().mean(0)
    return active.tolist(), float((active == 0).double().mean())


def test_tensordict_module_with_default_inplace_takes_backward_probes() -> None:
    torch.manual_seed(0)
    policy = Policy()
    assert policy.body.inplace is True
    model = PolicyAutoBuilder.wrap(policy)
    ctx = ComponentContext(strict=True)
    # TensorDictModule's inplace writes outputs into the input TensorDict: not rejected
    model.attach("body", attach_gradient_flow_hooks(), ctx, backward=True, extractor="hidden")
    td, a = batch()
    F.cross_entropy(model(td), a).backward()
    got = StatsReporter(ctx).collect()
    model.remove_hooks()
    h = policy.net(td["observation"]).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(policy.head(h), a), h)
    # one backward pass: the bias-corrected EMA is that pass's per-unit RMS
    torch.testing.assert_close(
        torch.tensor(got["probes/gradient_flow/body/rms"], dtype=torch.float64),
        g.double().square().mean(0).sqrt(),
    )


@pytest.mark.parametrize(
    "activation",
    [
        nn.ReLU(inplace=True),
        nn.LeakyReLU(inplace=True),
        nn.ELU(inplace=True),
        nn.Dropout(0.1, True),
    ],
)
def test_torch_modules_that_overwrite_activations_in_place_are_still_rejected(activation) -> None:
    net = nn.Sequential(nn.Linear(OBS, HIDDEN), activation, nn.Linear(HIDDEN, 2))
    body = TensorDictModule(net, in_keys=["observation"], out_keys=["hidden"])
    model = PolicyAutoBuilder.wrap(body, {"body": body})
    name = type(activation).__name__
    with pytest.raises(ProbeError, match=rf"body\.module\.1 is {name}\(inplace=True\)"):
        model.attach(
            "body",
            attach_gradient_flow_hooks(),
            ComponentContext(),
            backward=True,
            extractor="hidden",
        )


def test_an_inplace_attribute_on_other_modules_is_not_an_activation() -> None:
    class Writer(nn.Module):  # "inplace" in the TensorDict sense: writes into its input
        def __init__(self) -> None:
            super().__init__()
            self.inplace = True
            self.linear = nn.Linear(OBS, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    model = PolicyAutoBuilder.wrap(nn.Sequential(Writer()), {"body": "0"})
    ctx = ComponentContext(strict=True)
    model.attach("body", attach_fisher_information_hooks(), ctx, backward=True)
    x = torch.randn(5, OBS)
    model(x).sum().backward()
    assert StatsReporter(ctx).collect()["probes/fisher/body/samples"] == 5.0


def test_key_extractor_on_a_tensordict_output_matches_per_sample_gradients() -> None:
    torch.manual_seed(1)
    policy = Policy()
    model = PolicyAutoBuilder.wrap(policy)
    ctx = ComponentContext(strict=True)
    model.attach("body", attach_relu_activation_hooks(), ctx, extractor="hidden")
    model.attach("body", attach_fisher_information_hooks(), ctx, backward=True, extractor="hidden")
    td, a = batch(16)
    F.cross_entropy(model(td), a).backward()
    got = StatsReporter(ctx).collect()
    model.remove_hooks()

    obs = td["observation"]
    h = policy.net(obs).detach()
    active, dead = relu_reference(h)
    assert got["probes/relu/body/active_rate"] == pytest.approx(active)
    assert got["probes/relu/body/dead_fraction"] == pytest.approx(dead)
    assert got["probes/relu/body/samples"] == 16.0

    # per-sample losses l_i: Fisher per unit = mean_i (d l_i / d h_i)^2, per parameter
    # mean_i (d l_i / d theta)^2, both from torch.func
    head = dict(policy.head.named_parameters())

    def unit_loss(hi: torch.Tensor, ai: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(policy.head, head, (hi[None],))
        return F.cross_entropy(logits, ai[None])

    dh = torch.func.vmap(torch.func.grad(unit_loss))(h, a)
    torch.testing.assert_close(
        torch.tensor(got["probes/fisher/body/unit"], dtype=torch.float64),
        dh.double().square().mean(0),
    )
    params = {k: v.detach() for k, v in policy.net.named_parameters()}

    def param_loss(p: dict, oi: torch.Tensor, ai: torch.Tensor) -> torch.Tensor:
        hi = torch.func.functional_call(policy.net, p, (oi[None],))
        return F.cross_entropy(policy.head(hi), ai[None])

    per_sample = torch.func.vmap(torch.func.grad(param_loss), in_dims=(None, 0, 0))(params, obs, a)
    trace = sum(float(g.detach().double().square().mean(0).sum()) for g in per_sample.values())
    assert got["probes/fisher/body/trace"] == pytest.approx(trace, rel=1e-5)


def test_nested_key_extractor_reads_tensordict_and_plain_mappings() -> None:
    torch.manual_seed(2)
    policy = Policy(out_key=("next", "hidden"))
    model = PolicyAutoBuilder.wrap(policy)
    ctx = ComponentContext(strict=True)
    model.attach("body", attach_relu_activation_hooks(), ctx, extractor=("next", "hidden"))
    td, a = batch(10)
    F.cross_entropy(model(td), a).backward()
    got = StatsReporter(ctx).collect()
    assert got["probes/relu/body/active_rate"] == pytest.approx(
        relu_reference(policy.net(td["observation"]).detach())[0]
    )

    class Nested(nn.Module):
        def forward(self, x: torch.Tensor) -> dict:
            return {"next": {"hidden": torch.tanh(x)}, "x": x}

    plain = PolicyAutoBuilder.wrap(nn.Sequential(Nested()), {"body": "0"})
    ctx = ComponentContext(strict=True)
    plain.attach("body", attach_saturated_activation_hooks(), ctx, extractor=("next", "hidden"))
    x = 2 * torch.randn(9, 5)
    plain(x)
    got = StatsReporter(ctx).collect()
    ref = float((torch.tanh(x).abs() > 0.95).double().mean())
    assert got["probes/saturation_tanh/body/saturated_fraction"] == pytest.approx(ref)


class TupleBody(nn.Module):
    """Returns ``(hidden, state)`` like a recurrent core."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(OBS, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        h = torch.relu(self.linear(x))
        return h, (h.sum(-1), x)


class TuplePolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = TupleBody()
        self.head = nn.Linear(HIDDEN, ACT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[0])


def test_index_extractor_on_a_tuple_output() -> None:
    torch.manual_seed(3)
    policy = TuplePolicy()
    model = PolicyAutoBuilder.wrap(policy, example_inputs=(torch.zeros(1, OBS),))
    assert model.output_kind("body") == "sequence"
    ctx = ComponentContext(strict=True)
    model.attach("body", attach_relu_activation_hooks(), ctx, extractor=0)
    model.attach("body", attach_gradient_flow_hooks(), ctx, backward=True, extractor=0)
    x, a = torch.randn(11, OBS), torch.randint(0, ACT, (11,))
    F.cross_entropy(model(x), a).backward()
    got = StatsReporter(ctx).collect()
    h = policy.body(x)[0].detach().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(policy.head(h), a), h)
    assert got["probes/relu/body/active_rate"] == pytest.approx(relu_reference(h.detach())[0])
    torch.testing.assert_close(
        torch.tensor(got["probes/gradient_flow/body/rms"], dtype=torch.float64),
        g.double().square().mean(0).sqrt(),
    )


def test_index_out_of_range_and_missing_key_disable_the_probe_with_the_fix() -> None:
    model = PolicyAutoBuilder.wrap(TuplePolicy())
    ctx = ComponentContext()
    model.attach("body", attach_relu_activation_hooks(), ctx, extractor=5)
    model(torch.randn(3, OBS))
    assert (
        "extractor=5 is out of range: the component returned a tuple of 2 items"
        in (ctx.probe_errors["relu/body"])
    )
    td_model = PolicyAutoBuilder.wrap(Policy())
    ctx = ComponentContext()
    td_model.attach("body", attach_relu_activation_hooks(), ctx, extractor="hiddn")
    td_model(batch()[0])
    msg = ctx.probe_errors["relu/body"]
    assert "extractor='hiddn': no such key" in msg and "'hidden'" in msg
    assert len(msg) < 300


@pytest.mark.parametrize("bad", [1.5, True, "", (), ("next", 1), ["hidden"], {"k": 1}])
def test_bad_extractor_types_are_a_type_error_where_the_probe_is_placed(bad) -> None:
    for make in (
        attach_relu_activation_hooks,
        attach_saturated_activation_hooks,
        attach_fisher_information_hooks,
        attach_gradient_flow_hooks,
    ):
        with pytest.raises(TypeError, match="extractor must be a callable.*a key.*tuple index"):
            make().place(extractor=bad)


def big_tensordict_policy() -> tuple[TensorDictSequential, TensorDict]:
    """A TensorDictSequential whose output has many keys and 64 batch rows."""
    modules = [
        TensorDictModule(nn.Linear(OBS, HIDDEN), in_keys=["observation"], out_keys=["hidden"]),
        TensorDictModule(nn.ReLU(), in_keys=["hidden"], out_keys=[("next", "features")]),
    ]
    seq = TensorDictSequential(*modules)
    td = TensorDict(
        {
            "observation": torch.randn(64, OBS),
            **{f"aux_{i}": torch.zeros(64, 3) for i in range(10)},
        },
        batch_size=[64],
    )
    return seq, td


def test_tensordict_output_without_extractor_gets_a_short_error_listing_its_keys() -> None:
    seq, td = big_tensordict_policy()
    model = PolicyAutoBuilder.wrap(seq, {"body": seq}, example_inputs=(td.clone(),))
    assert model.output_kind("body") == "mapping"
    with pytest.raises(ProbeError) as err:
        model.attach("body", attach_gradient_flow_hooks(), ComponentContext(), backward=True)
    msg = str(err.value)
    assert len(msg) < 300, msg
    assert "TensorDict with keys ['observation'" in msg
    assert "and 7 more" in msg  # 13 leaves, 6 named
    assert 'Pass extractor="hidden"' in msg  # the first of the module's out_keys
    assert len(describe_type(td)) < 150  # keys, never the 64 rows


def test_untraced_backward_probe_on_a_tensordict_output_is_a_probe_error() -> None:
    # batch_size [] : iterating this TensorDict raises StopIteration at once
    body = TensorDictModule(nn.Linear(OBS, HIDDEN), in_keys=["observation"], out_keys=["hidden"])
    td = TensorDict({"observation": torch.randn(OBS)}, batch_size=[])
    model = PolicyAutoBuilder.wrap(body, {"body": body})
    ctx = ComponentContext()
    model.attach("body", attach_fisher_information_hooks(), ctx, backward=True)
    out = model(td.clone())  # not strict: disabled and reported, training goes on
    assert out["hidden"].shape == (HIDDEN,)
    msg = ctx.probe_errors["fisher/body"]
    assert msg.startswith("ProbeError: backward probe on component 'body' cannot fire")
    assert "TensorDict with keys ['observation', 'hidden']" in msg
    assert 'extractor="hidden"' in msg and len(msg) < 300  # the key that carries grad
    assert StatsReporter(ctx).collect()["probes/errors/fisher/body"] == 1.0

    model.remove_hooks()
    model.attach("body", attach_gradient_flow_hooks(), ComponentContext(strict=True), backward=True)
    with pytest.raises(ProbeError, match=r"TensorDict with keys \['observation', 'hidden'\]"):
        model(td.clone())


def test_forward_probe_error_on_a_tensordict_output_is_short() -> None:
    seq, td = big_tensordict_policy()
    model = PolicyAutoBuilder.wrap(seq, {"body": seq})
    ctx = ComponentContext()
    model.attach("body", attach_relu_activation_hooks(), ctx)
    model(td)
    msg = ctx.probe_errors["relu/body"]
    assert len(msg) < 300, msg
    assert "returned a TensorDict with keys ['observation'" in msg
    assert 'extractor="hidden"' in msg
