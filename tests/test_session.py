"""ProbeSession driven by a CleanRL-style PPO loop (the one in docs/external.md) and by
small loops: per-epoch records checked against computations from plain torch hooks."""

from __future__ import annotations

import csv
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NO_WANDB, TinyPolicy, hook_counts, saturation_reference
from torch import nn

from policy_probes import (
    PolicyAutoBuilder,
    ProbeSettings,
    Run,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
)
from policy_probes.records import read_jsonl
from policy_probes.session import ProbeSession

DOC = Path(__file__).resolve().parent.parent / "docs" / "external.md"
EXAMPLE_HEADER = "# cleanrl_ppo_with_probes.py"
DEAD = (0, 1, 2)  # units of actor.1 killed before training


def load_doc_example(
    header: str = EXAMPLE_HEADER, module_name: str = "docs_external_example"
) -> dict[str, Any]:
    """Execute the example of docs/external.md whose block starts with ``header`` (the
    CleanRL loop by default) and return its namespace."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    code = [b for b in blocks if b.startswith(header)]
    assert len(code) == 1, f"docs/external.md must hold exactly one block starting {header!r}"
    module = types.ModuleType(module_name)  # dataclasses need a real module
    sys.modules[module.__name__] = module
    exec(compile(code[0], str(DOC), "exec"), module.__dict__)
    return module.__dict__


class Capture:
    """Plain torch hooks (independent of policy_probes): outputs of some modules and the
    inputs and output gradients of Linear layers, for forwards with grad enabled (SB3 and
    CleanRL run their rollouts under no_grad)."""

    def __init__(self, outputs: dict[str, nn.Module], linears: dict[str, nn.Linear]):
        self.out: dict[str, list[torch.Tensor]] = {k: [] for k in outputs}
        self.grad: dict[str, list[torch.Tensor]] = {k: [] for k in [*outputs, *linears]}
        self.inp: dict[str, list[torch.Tensor]] = {k: [] for k in linears}
        self.handles = []
        for name, module in outputs.items():
            self.handles.append(module.register_forward_hook(self._output(name)))
        for name, module in linears.items():
            self.handles.append(module.register_forward_hook(self._linear(name)))

    def _output(self, name: str):
        def hook(_m, _i, out):
            if torch.is_grad_enabled():
                self.out[name].append(out.detach().clone())
                out.register_hook(lambda g: self.grad[name].append(g.detach().clone()))

        return hook

    def _linear(self, name: str):
        def hook(_m, inputs, out):
            if torch.is_grad_enabled():
                self.inp[name].append(inputs[0].detach().clone())
                out.register_hook(lambda g: self.grad[name].append(g.detach().clone()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def relu_reference(rows: torch.Tensor) -> dict[str, Any]:
    active = (rows > 0).double().mean(0)
    return {
        "active_rate": active,
        "dead_fraction": float((active == 0).double().mean()),
        "zero_fraction": float((rows <= 0).double().mean()),
        "samples": float(rows.shape[0]),
    }


def fisher_reference(
    out_grads: list[torch.Tensor], layers: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
) -> dict[str, Any]:
    """Empirical Fisher with per-sample gradients n * g_i (the loss is a minibatch mean):
    per output unit, and the trace over every Linear weight and bias of the component."""
    per_sample = [g.double() * g.shape[0] for g in out_grads]
    unit = torch.cat(per_sample).square().mean(0)
    trace = 0.0
    for inputs, grads in layers:
        n = sum(x.shape[0] for x in inputs)
        for x, g in zip(inputs, grads, strict=True):
            s = (g.double() * g.shape[0]).square()
            trace += float((s.sum(1) * x.double().square().sum(1)).sum() + s.sum()) / n
    return {"unit": unit, "trace": trace}


def check_relu(rec: dict[str, Any], name: str, rows: torch.Tensor) -> None:
    """The relu probe's keys for ``name`` in ``rec`` against :func:`relu_reference` of the
    ``rows`` it saw (on any device)."""
    ref = relu_reference(rows)
    key = f"probes/relu/{name}/"
    assert rec[key + "samples"] == ref["samples"]
    assert rec[key + "dead_fraction"] == pytest.approx(ref["dead_fraction"])
    assert rec[key + "zero_fraction"] == pytest.approx(ref["zero_fraction"])
    torch.testing.assert_close(
        torch.tensor(rec[key + "active_rate"], dtype=torch.float64), ref["active_rate"].cpu()
    )


def check_tanh_saturation(rec: dict[str, Any], name: str, h: torch.Tensor) -> None:
    """The tanh saturation probe's keys for ``name`` (threshold 0.95) against the
    outputs ``h`` it saw (on any device)."""
    key = f"probes/saturation_tanh/{name}/"
    saturated, derivative = saturation_reference(h.double(), "tanh", 0.95)
    sat = saturated.double()
    assert rec[key + "samples"] == h.shape[0]
    assert rec[key + "saturated_fraction"] == pytest.approx(float(sat.mean()))
    torch.testing.assert_close(
        torch.tensor(rec[key + "saturation_rate"]).double(), sat.mean(0).cpu()
    )
    assert rec[key + "mean_derivative"] == pytest.approx(float(derivative.mean()), rel=1e-6)


def check_fisher_unit(rec: dict[str, Any], component: str, unit: torch.Tensor) -> None:
    """The Fisher probe's per-unit vector for ``component`` against ``unit`` (float64, on
    any device)."""
    torch.testing.assert_close(
        torch.tensor(rec[f"probes/fisher/{component}/unit"], dtype=torch.float64),
        unit.cpu(),
        rtol=1e-5,
        atol=1e-12,
    )


def test_doc_cleanrl_loop_records_match_independent_computation(tmp_path):
    ns = load_doc_example()
    args = ns["Args"](
        total_timesteps=384,
        num_envs=2,
        num_steps=64,
        num_minibatches=2,
        update_epochs=2,
        run_dir=str(tmp_path),
        wandb_mode="disabled",
    )
    torch.manual_seed(0)
    agent = ns["Agent"](4, 2, hidden=16)
    with torch.no_grad():  # three dead units in the first ReLU layer
        for u in DEAD:
            agent.actor[0].weight[u].zero_()
            agent.actor[0].bias[u] = -50.0
    init = [p.detach().clone() for p in agent.parameters()]
    cap = Capture(
        {"actor.1": agent.actor[1], "actor.3": agent.actor[3], "critic.3": agent.critic[3]},
        {"actor.0": agent.actor[0], "actor.2": agent.actor[2], "actor.4": agent.actor[4]},
    )
    cap.grad["actor"] = []

    def actor_grad(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            out.register_hook(lambda g: cap.grad["actor"].append(g.clone()))

    cap.handles.append(agent.actor.register_forward_hook(actor_grad))
    own_hooks = hook_counts(agent)

    ns["train"](args, agent)

    assert hook_counts(agent) == own_hooks  # every session hook removed
    cap.remove()
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    batch = args.num_envs * args.num_steps
    epochs = args.total_timesteps // batch
    assert [r["epoch"] for r in records] == list(range(1, epochs + 1))
    assert [r["agent_step"] for r in records] == [batch * (e + 1) for e in range(epochs)]
    calls = args.update_epochs * args.num_minibatches  # recorded forwards per epoch
    assert len(cap.out["actor.1"]) == epochs * calls

    for e, rec in enumerate(records):
        window = slice(e * calls, (e + 1) * calls)
        for name in ("actor.1", "actor.3"):
            check_relu(rec, name, torch.cat(cap.out[name][window]))  # the training rows only
            assert rec[f"probes/relu/{name}/samples"] == args.update_epochs * batch  # no rollout
        assert rec["probes/relu/actor.1/dead_fraction"] >= len(DEAD) / 16

        check_tanh_saturation(rec, "critic.3", torch.cat(cap.out["critic.3"][window]))

        # backward hooks fire in reverse order of the forward; one gradient per call
        layers = [
            (cap.inp[n][window], cap.grad[n][window]) for n in ("actor.0", "actor.2", "actor.4")
        ]
        ref = fisher_reference(cap.grad["actor"][window], layers)
        check_fisher_unit(rec, "actor", ref["unit"])
        assert rec["probes/fisher/actor/trace"] == pytest.approx(ref["trace"], rel=1e-5)
        for key in ("train/policy_loss", "train/value_loss", "train/explained_variance"):
            assert isinstance(rec[key], float)
        assert rec["norms/grad_norm"] > 0

    final = [p.detach() for p in agent.parameters()]
    weight_norm = torch.linalg.vector_norm(torch.stack([p.norm() for p in final]))
    dist = torch.linalg.vector_norm(
        torch.stack([(p - q).norm() for p, q in zip(final, init, strict=True)])
    )
    assert records[-1]["norms/weight_norm"] == pytest.approx(float(weight_norm), rel=1e-5)
    assert records[-1]["norms/dist_from_init"] == pytest.approx(float(dist), rel=1e-5)
    with open(tmp_path / "metrics.csv") as f:  # sinks flushed and closed
        rows = [r for r in csv.DictReader(f) if r["hook_point"] == "POST_EPOCH"]
    assert [int(r["epoch"]) for r in rows] == list(range(1, epochs + 1))


def _tiny_epoch(session: ProbeSession, model: nn.Module, opt, n: int = 32) -> None:
    """One epoch on rows drawn on the CPU (the same on every device), on the model's
    device."""
    device = next(model.parameters()).device
    x = torch.randn(n, 5).to(device)
    with session.phase("rollout"), torch.no_grad():
        model(torch.randn(7, 5).to(device))  # not recorded
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_hooks_removed_and_sinks_flushed_when_the_loop_raises(tmp_path, device: torch.device):
    torch.manual_seed(0)
    model = TinyPolicy().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert hook_counts(model) == 0
    with (
        pytest.raises(RuntimeError, match="env crashed"),
        ProbeSession(model, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)) as session,
    ):
        session.add_training_hook("actor_mlp.*", attach_relu_activation_hooks())
        session.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
        assert hook_counts(model) > 0
        _tiny_epoch(session, model, opt)
        session.epoch_end(step=32)
        _tiny_epoch(session, model, opt)
        raise RuntimeError("env crashed")
    assert session.closed
    assert hook_counts(model) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["epoch"], r["agent_step"]) for r in records] == [(1, 32)]
    assert records[0]["probes/relu/actor_mlp.layer_0/samples"] == 32.0  # rollout rows left out
    with open(tmp_path / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) == 1


def test_epoch_record_matches_a_clone_run_on_the_same_minibatches(tmp_path, device: torch.device):
    torch.manual_seed(1)
    model = TinyPolicy(hidden=(6,)).to(device)
    clone = TinyPolicy(hidden=(6,)).to(device)
    clone.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with ProbeSession(model, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)) as session:
        session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        seen = []
        for _ in range(3):
            with torch.no_grad():  # the minibatch through the clone, before the step
                clone.load_state_dict(model.state_dict())
            x = torch.randn(16, 5).to(device)
            seen.append(clone.actor_mlp(x).detach())
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        session.log({"train/loss": loss.detach()})
        out = session.epoch_end(step=48, **{"rollout/episode_return": 3.5})
    check_relu(out, "actor_mlp", torch.cat(seen))
    assert out["train/loss"] == pytest.approx(float(loss.detach()))
    assert out["rollout/episode_return"] == 3.5
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec["probes/relu/actor_mlp/active_rate"] == out["probes/relu/actor_mlp/active_rate"]


def test_log_last_and_mean_phase_context_and_names(tmp_path, device: torch.device):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).to(device)
    with ProbeSession(model, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)) as session:
        assert isinstance(session.policy, PolicyAutoBuilder)
        assert session.component_names[:2] == ["0", "1"]
        with pytest.raises(KeyError, match="Available components: 0, 1, 2"):
            session.add_training_hook("relu", attach_relu_activation_hooks())
        with pytest.raises(TypeError, match="parentheses"):
            session.add_training_hook("1", attach_relu_activation_hooks)
        builder = attach_relu_activation_hooks()
        session.add_training_hook("1", builder)
        with pytest.raises(ValueError, match="already attached"):
            session.add_training_hook("1", builder)
        assert session.current_phase == "train"
        with session.phase("eval"):
            assert session.current_phase == "eval"
            model(torch.randn(5, 3).to(device))  # not recorded
        assert session.current_phase == "train"
        for v in (1.0, 2.0, 6.0):
            session.log({"a": torch.tensor(v).to(device)}, reduce="mean")  # kept on the device
            session.log({"b": v})
        out = session.epoch_end(step=10)
        assert out["a"] == pytest.approx(3.0) and out["b"] == 6.0
        assert not any(k.startswith("probes/relu/1/") for k in out)  # nothing recorded
        assert "a" not in session.epoch_end(step=20)  # logs belong to one epoch
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_wrapped_components_and_policy_autobuilder_models(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with ProbeSession(
        model, components={"body": "0"}, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)
    ) as s:
        assert s.component_names == ["body"]
    policy = TinyPolicy()
    with pytest.raises(ValueError, match="drop components"):
        ProbeSession(
            policy,
            components={"x": "actor_mlp"},
            run=Run(tmp_path),
            probing=ProbeSettings(**NO_WANDB),
        )
    # a second run: its own run_dir (the first one's is refused, test_session_reliability)
    with ProbeSession(policy, run=Run(tmp_path / "second"), probing=ProbeSettings(**NO_WANDB)) as s:
        assert s.policy is policy


def test_lifecycle_selection_is_checked_against_what_the_loop_provides(tmp_path):
    model = TinyPolicy()
    for hook, match in (("counterfactual", "intervention"), ("adam_dynamics", "optimizer")):
        probing = ProbeSettings(hooks=[hook], **NO_WANDB)
        # checked when the loop starts without binding what the hook needs
        with (
            ProbeSession(model, run=Run(tmp_path / hook), probing=probing) as session,
            pytest.raises(ValueError, match=match),
        ):
            session.set_phase("rollout")
        assert not (tmp_path / hook / "config.json").exists()  # nothing written
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="snapshot_every"):
        ProbeSession(
            model,
            optimizer=opt,
            loss_fn=lambda m, b: m(b).square().mean(),
            run=Run(tmp_path),
            probing=ProbeSettings(hooks=["hessian"], **NO_WANDB),
        )
    assert hook_counts(model) == 0


def _regression_run(
    tmp_path: Path, hooks: list[str], device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(3)
    model = TinyPolicy().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 5), torch.randn(8, 3)) for _ in range(3)]
    data = [(x.to(device), y.to(device)) for x, y in data]

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (m(batch[0]) - batch[1]).square().mean()

    out = {}
    with ProbeSession(
        model,
        optimizer=opt,
        loss_fn=loss_fn,
        run=Run(tmp_path),
        probing=ProbeSettings(hooks=hooks, probe_budget=None, **NO_WANDB),
    ) as session:
        session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        for epoch in range(2):
            session.set_data(minibatches=data)
            for batch in data:
                opt.zero_grad()
                loss_fn(model, batch).backward()
                opt.step()
            out = session.epoch_end(step=24 * (epoch + 1))
    return [p.detach().clone() for p in model.parameters()], out


def test_interventions_leave_the_trajectory_bit_identical(tmp_path, device: torch.device):
    plain, _ = _regression_run(tmp_path / "a", [], device)
    hooks = ["counterfactual", "adam_dynamics", "norms"]
    probed, out = _regression_run(tmp_path / "b", hooks, device)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed, strict=True))
    assert out["counterfactual/update_norm"] > 0
    assert "counterfactual/error" not in out
    assert out["adam_dynamics/optimizer_step"] == 6.0
    assert "probes/relu/actor_mlp/dead_fraction" in out
