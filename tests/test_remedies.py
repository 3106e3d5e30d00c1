"""Shrink-and-perturb and layer resets against their formulas computed by hand, triggers,
determinism, the session's remedy state, specs and bad configuration."""

from __future__ import annotations

import pytest
import torch
from conftest import JSONL_ONLY, REMEDY_SEED, ReluNet, remedy_seeds, remedy_session, snapshot
from torch import nn

from policy_probes import ProbeSettings, Run
from policy_probes.plugins import from_spec, registered, split_specs
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.remedies import (
    redo,
    reset_layers,
    shrink_and_perturb,
)
from policy_probes.session import ProbeSession


def fresh_linear(i: int, o: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(i, o)


def make_session(tmp_path, model, optimizer=None):
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=1e-2)
    return remedy_session(tmp_path, model, opt), opt


def update(session, model, opt, n: int = 2, seed: int = 0) -> None:
    """``n`` updates on batches drawn on the CPU, then moved to the model's device."""
    session.set_phase("train")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = model(torch.randn(16, 5, generator=g).to(device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_shrink_and_perturb_formula(tmp_path, device: torch.device):
    torch.manual_seed(0)
    model = ReluNet().to(device)
    session, opt = make_session(tmp_path, model)
    session.add_remedy(
        "body", shrink_and_perturb(shrink=0.7, noise=0.05, every_epochs=1, seed=REMEDY_SEED)
    )
    with session:
        update(session, model, opt)
        rng = torch.get_rng_state()
        before, moments = snapshot(model, opt)
        metrics = session.epoch_end(step=1)
        assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    s0, s1 = remedy_seeds(REMEDY_SEED, "shrink_and_perturb", "body", 2)
    # the remedy draws its fresh values on the CPU (its own CPU generator, then moved)
    f = {
        "body.0": fresh_linear(5, 16, s0).to(device),
        "body.2": fresh_linear(16, 12, s1).to(device),
    }
    for name, p in model.named_parameters():
        layer, _, kind = name.rpartition(".")
        if layer in f:
            expected = 0.7 * before[name] + 0.05 * getattr(f[layer], kind).detach()
            assert torch.allclose(p.detach(), expected, rtol=1e-6, atol=1e-7), name
            assert not torch.equal(p.detach(), before[name])
        else:
            assert torch.equal(p.detach(), before[name])
        for key, value in moments[name].items():  # the optimiser state is kept
            assert torch.equal(opt.state[p][key], value)
    assert metrics["remedies/shrink_and_perturb/body/fired"] == 1.0
    assert metrics["remedies/shrink_and_perturb/body.0/units_reset"] == 16.0


@pytest.mark.parametrize("spec", [{"layers": ["2"]}, {"last": 1}])
def test_reset_layers_formula_and_fresh_optimizer_state(tmp_path, spec, device: torch.device):
    torch.manual_seed(1)
    model = ReluNet().to(device)
    session, opt = make_session(tmp_path, model)
    session.add_remedy("body", reset_layers(**spec, every_epochs=1, seed=REMEDY_SEED))
    with session:
        update(session, model, opt)
        before, moments = snapshot(model, opt)
        metrics = session.epoch_end(step=1)
    (s,) = remedy_seeds(REMEDY_SEED, "reset_layers", "body", 1)
    f = fresh_linear(16, 12, s).to(device)
    p = dict(model.named_parameters())
    assert torch.equal(p["body.2.weight"].detach(), f.weight.detach())
    assert torch.equal(p["body.2.bias"].detach(), f.bias.detach())
    for name in ("body.2.weight", "body.2.bias"):
        st = opt.state[p[name]]
        assert not st["exp_avg"].any() and not st["exp_avg_sq"].any()
        assert float(st["step"]) == 0.0
    for name in ("body.0.weight", "body.0.bias", "head.weight", "head.bias"):
        assert torch.equal(p[name].detach(), before[name])
        for key, value in moments[name].items():
            assert torch.equal(opt.state[p[name]][key], value)
    assert metrics["remedies/reset_layers/body/units_reset"] == 12.0


def test_sgd_momentum_buffers_reset(tmp_path, device: torch.device):
    torch.manual_seed(2)
    model = ReluNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session, _ = make_session(tmp_path, model, optimizer=opt)
    session.add_remedy("head", reset_layers(last=1, every_epochs=1, seed=REMEDY_SEED))
    with session:
        update(session, model, opt)
        before, moments = snapshot(model, opt)
        assert opt.state[model.head.weight]["momentum_buffer"].any()
        session.epoch_end(step=1)
    assert not opt.state[model.head.weight]["momentum_buffer"].any()
    assert torch.equal(
        opt.state[model.body[0].weight]["momentum_buffer"],
        moments["body.0.weight"]["momentum_buffer"],
    )


def fired_epochs(
    tmp_path, remedy, values=None, epochs=6, device: torch.device = torch.device("cpu")
) -> list[int]:
    """Epochs (1-based) at which ``remedy`` fired on ``head`` (the model on ``device``);
    ``values`` are logged as ``train/x`` each epoch for threshold triggers."""
    torch.manual_seed(3)
    model = ReluNet().to(device)
    session, opt = make_session(tmp_path, model)
    session.add_remedy("head", remedy)
    fired = []
    with session:
        for epoch in range(1, epochs + 1):
            update(session, model, opt, n=1)
            if values is not None:
                session.log({"train/x": values[epoch - 1]})
            if session.epoch_end(step=epoch)["remedies/reset_layers/head/fired"]:
                fired.append(epoch)
    return fired


def test_triggers(tmp_path, device: torch.device):
    def fired(name, remedy, values=None):
        return fired_epochs(tmp_path / name, remedy, values, device=device)

    assert fired("a", reset_layers(last=1, every_epochs=2)) == [2, 4, 6]
    assert fired("b", reset_layers(last=1, every_epochs=2, start_epoch=3)) == [4, 6]
    x = [0.9, 0.9, 0.9, 0.1, 0.9, 0.9]
    assert fired("c", reset_layers(last=1, when="train/x>0.5"), x) == [1, 2, 3, 5, 6]
    assert fired("d", reset_layers(last=1, when="train/x>0.5", cooldown=1), x) == [1, 3, 5]
    assert fired("e", reset_layers(last=1, every_epochs=2, when="train/x<=0.1"), x) == [4]


def run_with_remedies(tmp_path, remedy_seed, torch_seed=4, device=torch.device("cpu")):
    torch.manual_seed(torch_seed)
    model = ReluNet()
    with torch.no_grad():
        model.body[0].bias[:4] = -50.0
    model.to(device)
    session, opt = make_session(tmp_path, model)
    session.add_training_hook("body", attach_relu_activation_hooks())
    session.add_remedy("body", redo(tau=0.05, every_epochs=1, consumer="head", seed=remedy_seed))
    session.add_remedy("head", shrink_and_perturb(every_epochs=2, seed=remedy_seed))
    with session:
        units = 0.0
        for epoch in range(1, 5):
            update(session, model, opt, seed=epoch)
            units += session.epoch_end(step=epoch)["remedies/redo/body/units_reset"]
        state = session.state_dict()["remedies"]
    assert units > 0
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def test_deterministic_for_a_seed(tmp_path, device: torch.device):
    a, state_a = run_with_remedies(tmp_path / "a", 11, device=device)
    b, state_b = run_with_remedies(tmp_path / "b", 11, device=device)
    c, _ = run_with_remedies(tmp_path / "c", 12, device=device)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)
    assert torch.equal(state_a["redo@body"]["generator"], state_b["redo@body"]["generator"])
    assert (
        state_a["redo@body"]["firings"] == 4 and state_a["shrink_and_perturb@head"]["firings"] == 2
    )


def test_session_state_round_trip_restores_generator_and_record(tmp_path, device: torch.device):
    torch.manual_seed(5)
    model = ReluNet().to(device)
    session, opt = make_session(tmp_path / "a", model)
    session.add_remedy("head", shrink_and_perturb(every_epochs=1, cooldown=1, seed=REMEDY_SEED))
    with session:
        update(session, model, opt)
        session.epoch_end(step=1)
        saved = session.state_dict()
    bound = session.remedies.bound[0]
    replay = torch.Generator()
    replay.set_state(bound.generator.get_state())
    next_seed = int(torch.randint(0, 2**62, (1,), generator=replay))
    other, opt2 = make_session(tmp_path / "b", ReluNet().to(device))
    other.add_remedy("head", shrink_and_perturb(every_epochs=1, cooldown=1, seed=99))
    with other:
        other.load_state_dict(saved)
        restored = other.remedies.bound[0]
        assert restored.last_fired == 1 and restored.firings == 1
        assert int(torch.randint(0, 2**62, (1,), generator=restored.generator)) == next_seed


# ---------------------------------------------------------------- configuration errors
def test_bad_configuration_messages(tmp_path):
    with pytest.raises(ValueError, match="tau must be >= 0"):
        redo(tau=-0.1, every_epochs=1)
    with pytest.raises(ValueError, match="needs a trigger"):
        redo(tau=0.1)
    with pytest.raises(ValueError, match="when='<metric><op><number>'|not a threshold"):
        redo(when="dormant_fraction is high")
    with pytest.raises(ValueError, match="exactly one of layers"):
        reset_layers(every_epochs=1)
    with pytest.raises(ValueError, match=r"shrink must be in \[0, 1\]"):
        shrink_and_perturb(shrink=1.5, every_epochs=1)

    model = ReluNet()
    session, _ = make_session(tmp_path / "a", model)
    with session:
        with pytest.raises(ValueError, match="attach_relu_activation_hooks"):
            session.add_remedy("body", redo(every_epochs=1, consumer="head"))
        session.add_training_hook("body", attach_relu_activation_hooks())
        with pytest.raises(ValueError, match="no consumer is named; pass consumer="):
            session.add_remedy("body", redo(every_epochs=1))
        with pytest.raises(ValueError, match=r"no parametrised layer 'nope'; choose from"):
            session.add_remedy("body", reset_layers(layers=["nope"], every_epochs=1))
        with pytest.raises(KeyError):
            session.add_remedy("missing", reset_layers(last=1, every_epochs=1))

    session, _ = make_session(
        tmp_path / "b", model, optimizer=torch.optim.RMSprop(model.parameters())
    )
    with (
        session,
        pytest.raises(TypeError, match=r"torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD"),
    ):
        session.add_remedy("head", reset_layers(last=1, every_epochs=1))

    eval_only = ProbeSession(
        model, run=Run(tmp_path / "c"), probing=ProbeSettings(sinks=JSONL_ONLY)
    )
    with eval_only, pytest.raises(ValueError, match="without optimizer"):
        eval_only.add_remedy("head", reset_layers(last=1, every_epochs=1))
        eval_only.set_phase("train")  # the loop starts without an optimizer: refused


def test_redo_refuses_a_normalisation_between_a_layer_and_its_consumer(tmp_path):
    model = nn.Sequential()
    model.add_module(
        "body", nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
    )
    session, _ = make_session(tmp_path, model)
    with session:
        session.add_training_hook("body", attach_relu_activation_hooks())
        with pytest.raises(
            ValueError, match=r"LayerNorm\) reads the units next.*a normalisation mixes"
        ):
            session.add_remedy("body", redo(every_epochs=1))


def parse_remedy_spec(spec: str):
    component, remedy, rest = from_spec(spec, "remedy")
    assert rest == {}
    return component, remedy


def test_specs():
    component, remedy = parse_remedy_spec("redo@critic_mlp:tau=0.025,every_epochs=25")
    assert component == "critic_mlp" and remedy.tau == 0.025
    assert remedy.trigger.every_epochs == 25
    _, r = parse_remedy_spec(
        "reset_layers@critic_mlp:layers=layer_1.linear|layer_0.linear,every_epochs=3"
    )
    assert r.layers == ["layer_1.linear", "layer_0.linear"]
    _, r = parse_remedy_spec("redo@c:when=probes/relu/c/dormant_fraction>0.3,cooldown=5")
    assert (r.trigger.when.key, r.trigger.when.op, r.trigger.when.value) == (
        "probes/relu/c/dormant_fraction",
        ">",
        0.3,
    )
    assert split_specs('["redo@a:every_epochs=1", "redo@b:every_epochs=2"]', "remedy") == [
        "redo@a:every_epochs=1",
        "redo@b:every_epochs=2",
    ]
    specs = "redo@a:every_epochs=1; shrink_and_perturb@b:every_epochs=2"
    assert split_specs(specs, "remedy") == [
        "redo@a:every_epochs=1",
        "shrink_and_perturb@b:every_epochs=2",
    ]
    # the built-in ones (a test module registers a remedy of its own)
    known = sorted(
        n for n, c in registered("remedy").items() if c.__module__.startswith("policy_probes.")
    )
    assert known == [
        "continual_backprop",
        "l2_init",
        "plasticity_injection",
        "redo",
        "reset_layers",
        "shrink_and_perturb",
        "soft_shrink_perturb",
    ]
    with pytest.raises(
        ValueError, match=r"unknown remedy 'redoo'. Did you mean 'redo'\? Registered:"
    ):
        parse_remedy_spec("redoo@a:every_epochs=1")
    with pytest.raises(ValueError, match=r"'taux' is no key of redo; keys: \['tau', 'consumer'"):
        parse_remedy_spec("redo@a:taux=1,every_epochs=1")
    with pytest.raises(ValueError, match="tau must be >= 0"):
        parse_remedy_spec("redo@a:tau=-1,every_epochs=1")
    with pytest.raises(ValueError, match="name@component"):
        parse_remedy_spec("redo:tau=1")


def test_a_remedy_pins_the_probes_it_reads_to_a_rule_of_pass_counters(
    tmp_path, device: torch.device
):
    """The ReLU probe that ReDo reads keeps the default stride (passes 0 and 16 of each
    32-pass epoch) even where the budget's calibration chose a larger one for the ReLU
    probe (here set by hand, as a slow probe would make it): which units a firing
    recycles depends on the seed and the settings only. The same probe on another
    component follows the calibration."""
    from policy_probes.sampling import DEFAULT_STRIDE
    from policy_probes.torch_internals import module_hooks_installed

    torch.manual_seed(REMEDY_SEED)
    model = ReluNet().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    session = ProbeSession(
        model, optimizer=opt, run=Run(tmp_path), probing=ProbeSettings(sinks=JSONL_ONLY)
    )
    session.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
    session.add_training_hook("head", attach_relu_activation_hooks(), per_layer=False)
    session.add_remedy("body", redo(tau=0.1, every_epochs=2, consumer="head"))
    session.sampler.observe_every = {"relu": 4 * DEFAULT_STRIDE}
    session.sampler.calibrated_epoch = 0
    passes = 2 * DEFAULT_STRIDE
    with session:
        for epoch in range(3):
            observed, head = [], []
            session.set_phase("train")
            g = torch.Generator().manual_seed(epoch)
            for _ in range(passes):
                observed.append(module_hooks_installed(session.policy.get_component("body")))
                head.append(module_hooks_installed(session.policy.get_component("head")))
                loss = model(torch.randn(16, 5, generator=g).to(device)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            record = session.epoch_end(step=epoch)
            assert observed == [i % DEFAULT_STRIDE == 0 for i in range(passes)]
            assert head == [i == 0 for i in range(passes)]
            assert record["probes/relu/body/passes_observed"] == 2
            assert record["probes/relu/body/samples"] == 16 * 2
            assert record["probes/relu/head/passes_observed"] == 1
    assert "body" in session.sampler.pinned and "head" not in session.sampler.pinned
