"""Sampling schedules: which passes probes observe, and what they report about them.

Every sampled metric is compared with an independent computation over exactly the passes
the schedule observes (plain tensor ops and ``vmap(grad(...))`` per-sample gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import NO_WANDB, ReluNet
from torch import nn
from torch.func import functional_call, grad, vmap

from policy_probes import (
    ProbeSettings,
    Run,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.integrations.sb3 import ProbeCallback
from policy_probes.sampling import (
    as_schedule,
    every,
    every_k,
    per_epoch,
    probe_batch,
    standard_error,
)
from policy_probes.session import ProbeSession

REL = 1e-5


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["obs"]), batch["act"])


def make_data(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(n, 5, generator=g), "act": torch.randint(0, 3, (n,), generator=g)}


def minibatches(data: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = data["obs"].shape[0]
    return [{k: v[i : i + size] for k, v in data.items()} for i in range(0, n, size)]


def reference(
    net: ReluNet, seen: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Over the observed passes (parameters at that pass, minibatch): ReLU active rate of
    the body output, and the Fisher (mean squared per-sample gradient) of body's params."""
    body, head = net.body, net.head
    h_all, sq, n = [], None, 0
    for params, batch in seen:
        body_p = {k.removeprefix("body."): v for k, v in params.items() if k.startswith("body.")}
        head_p = {k.removeprefix("head."): v for k, v in params.items() if k.startswith("head.")}

        def loss_one(
            p: dict, x: torch.Tensor, a: torch.Tensor, head_p: dict = head_p
        ) -> torch.Tensor:
            h = functional_call(body, p, (x[None],))
            return F.cross_entropy(functional_call(head, head_p, (h,)), a[None])

        grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(body_p, batch["obs"], batch["act"])
        squares = {k: (g.double() ** 2).sum(0) for k, g in grads.items()}
        sq = squares if sq is None else {k: sq[k] + squares[k] for k in sq}
        n += batch["obs"].shape[0]
        with torch.no_grad():
            h_all.append(functional_call(body, body_p, (batch["obs"],)))
    h = torch.cat(h_all)
    out = {"active_rate": (h > 0).double().mean(0)}
    out.update({f"{k}.trace": (v / n).sum() for k, v in sq.items()})
    return out


def run_epochs(session: ProbeSession, net: ReluNet, opt: torch.optim.Optimizer, epochs: list[list]):
    """Train minibatch by minibatch; returns every epoch's record and, per epoch, every
    pass's (parameters before the step, minibatch)."""
    records, passes = [], []
    for batches in epochs:
        session.set_phase("train")
        seen = []
        for batch in batches:
            seen.append(({k: v.detach().clone() for k, v in net.named_parameters()}, batch))
            opt.zero_grad()
            loss_fn(net, batch).backward()
            opt.step()
        passes.append(seen)
        records.append(session.epoch_end(step=len(records)))
    return records, passes


def check(record: dict, ref: dict[str, torch.Tensor], rows: int, passes: int) -> None:
    assert record["probes/relu/body/active_rate"] == pytest.approx(
        ref["active_rate"].tolist(), rel=REL
    )
    rate = ref["active_rate"]
    assert record["probes/relu/body/dead_fraction"] == pytest.approx(
        float((rate == 0).double().mean())
    )
    se = (rate * (1 - rate) / rows).sqrt().mean()
    assert record["probes/relu/body/active_rate_se"] == pytest.approx(float(se), rel=REL)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert record[f"probes/fisher/body/{name}.trace"] == pytest.approx(
            float(ref[f"{name}.trace"]), rel=1e-4
        )
    assert record["probes/relu/body/samples"] == rows
    for probe in ("relu", "fisher"):
        assert record[f"probes/{probe}/body/passes_observed"] == passes
        assert record[f"probes/{probe}/body/rows_observed"] == rows


def test_every_k_equals_a_reference_over_exactly_the_observed_passes(tmp_path):
    torch.manual_seed(0)
    net = ReluNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    data = minibatches(make_data(80), 8)  # 10 passes per epoch
    with ProbeSession(
        net, optimizer=opt, run=Run(tmp_path), probing=ProbeSettings(probe_budget=None, **NO_WANDB)
    ) as s:
        s.add_training_hook("body", attach_relu_activation_hooks(), schedule=every_k(3))
        s.add_training_backward_hook(
            "body", attach_fisher_information_hooks(), schedule="every_k:3"
        )
        records, passes = run_epochs(s, net, opt, [data, data])
    # the pass counter runs over the run: passes 0, 3, 6, 9 | 12, 15, 18 (epoch 2: 2, 5, 8)
    check(records[0], reference(net, [passes[0][i] for i in (0, 3, 6, 9)]), 32, 4)
    check(records[1], reference(net, [passes[1][i] for i in (2, 5, 8)]), 24, 3)


def test_per_epoch_spreads_n_passes_over_the_epoch(tmp_path):
    torch.manual_seed(1)
    net = ReluNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    data = minibatches(make_data(96), 8)  # 12 passes per epoch
    with ProbeSession(
        net,
        optimizer=opt,
        run=Run(tmp_path),
        probing=ProbeSettings(probe_schedule=per_epoch(3), **NO_WANDB),
    ) as s:
        s.add_training_hook("body", attach_relu_activation_hooks())
        s.add_training_backward_hook("body", attach_fisher_information_hooks())
        records, passes = run_epochs(s, net, opt, [data, data])
    # epoch 1 does not know the epoch's length yet: its first 3 passes; then every 4th
    check(records[0], reference(net, passes[0][:3]), 24, 3)
    check(records[1], reference(net, [passes[1][i] for i in (0, 4, 8)]), 24, 3)


def test_next_pass_ends_passes_without_an_optimizer(tmp_path):
    torch.manual_seed(2)
    net = ReluNet()
    data = minibatches(make_data(40), 8)
    with ProbeSession(
        net, run=Run(tmp_path), probing=ProbeSettings(probe_schedule=every_k(2), **NO_WANDB)
    ) as s:
        s.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
        s.set_phase("train")
        for batch in data:
            net(batch["obs"])
            s.next_pass()
        record = s.epoch_end(step=40)
    with torch.no_grad():
        h = torch.cat([net.body(data[i]["obs"]) for i in (0, 2, 4)])
    assert record["probes/relu/body/active_rate"] == pytest.approx(
        (h > 0).double().mean(0).tolist(), rel=REL
    )
    assert record["probes/relu/body/passes_observed"] == 3


def count_hooks(module: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in module.modules()
    )


def test_unobserved_passes_run_with_no_hooks_installed(tmp_path):
    torch.manual_seed(3)
    net = ReluNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = minibatches(make_data(64), 8)
    module_hooks, tensor_hooks = [], []
    with ProbeSession(
        net,
        optimizer=opt,
        run=Run(tmp_path),
        probing=ProbeSettings(probe_schedule="every_k:4", **NO_WANDB),
    ) as s:
        # per-layer hooks, gradient taps, the Fisher's Linear-input hooks, ReLU tensor hooks
        s.add_training_hook("body", attach_relu_activation_hooks())
        s.add_training_hook("body", attach_saturated_activation_hooks())
        s.add_training_backward_hook("body", attach_fisher_information_hooks())
        s.add_training_backward_hook("body", attach_gradient_flow_hooks())
        s.add_training_backward_hook("body", attach_relu_gradient_flow_hooks())
        s.set_phase("train")
        for batch in data:
            module_hooks.append(count_hooks(net))
            opt.zero_grad()
            h = net.body(batch["obs"])
            tensor_hooks.append(h._backward_hooks is not None)
            F.cross_entropy(net.head(h), batch["act"]).backward()
            opt.step()
        record = s.epoch_end(step=64)
    observed = [i % 4 == 0 for i in range(len(data))]
    assert [n > 0 for n in module_hooks] == observed
    assert [n for n, o in zip(module_hooks, observed, strict=True) if not o] == [0] * 6
    assert tensor_hooks == observed
    assert record["probes/relu/body/passes_observed"] == 2
    assert record["probes/relu_gradient_flow/body/passes_observed"] == 2


def test_probe_batch_leaves_the_run_bit_identical(tmp_path):
    def run(with_probes: bool) -> tuple[list[torch.Tensor], dict, list]:
        torch.manual_seed(4)
        net = ReluNet()
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        data = make_data(64, seed=5)
        out: dict = {}
        with ProbeSession(
            net,
            optimizer=opt,
            loss_fn=loss_fn,
            run=Run(tmp_path / str(with_probes)),
            probing=ProbeSettings(probe_schedule=probe_batch(24), **NO_WANDB),
        ) as s:
            if with_probes:
                s.add_training_hook("body", attach_relu_activation_hooks())
                s.add_training_backward_hook("body", attach_fisher_information_hooks())
            for epoch in range(3):
                s.set_phase("train")
                s.set_data(data=data, minibatch_size=16)
                order = torch.randperm(64)  # the loop's own use of the global RNG
                for i in range(0, 64, 16):
                    idx = order[i : i + 16]
                    opt.zero_grad()
                    loss_fn(net, {k: v[idx] for k, v in data.items()}).backward()
                    opt.step()
                out = s.epoch_end(step=64 * (epoch + 1))
                data = make_data(64, seed=6 + epoch)
            grads = [p.grad.clone() for p in net.parameters()]
        state = [v.clone() for st in opt.state.values() for v in st.values()]
        params = [p.detach().clone() for p in net.parameters()]
        return params + grads + state, out, [torch.rand(3)]

    plain, _, rng_plain = run(False)
    probed, out, rng_probed = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed, strict=True))
    assert torch.equal(rng_plain[0], rng_probed[0])
    # the probes saw only the dedicated pass: 24 rows, one pass
    assert out["probes/relu/body/samples"] == 24
    assert out["probes/relu/body/passes_observed"] == 1
    assert out["probes/fisher/body/rows_observed"] == 24


def test_probe_batch_metric_matches_the_rows_it_draws(tmp_path):
    torch.manual_seed(7)
    net = ReluNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = make_data(50, seed=8)
    with ProbeSession(
        net, optimizer=opt, loss_fn=loss_fn, run=Run(tmp_path), probing=ProbeSettings(**NO_WANDB)
    ) as s:
        s.add_training_hook("body", attach_relu_activation_hooks(), schedule=probe_batch(20))
        s.add_training_backward_hook(
            "body", attach_fisher_information_hooks(), schedule=probe_batch(20)
        )
        s.set_data(data=data, minibatch_size=10)
        params = {k: v.detach().clone() for k, v in net.named_parameters()}
        record = s.epoch_end(step=50)
    # the documented draw: randperm of a torch.Generator seeded 0, first 20, sorted
    idx = torch.randperm(50, generator=torch.Generator().manual_seed(0))[:20].sort().values
    ref = reference(net, [(params, {k: v[idx] for k, v in data.items()})])
    check(record, ref, 20, 1)


def test_sampling_leaves_training_bit_identical(tmp_path):
    def run(probes: bool) -> list[torch.Tensor]:
        torch.manual_seed(9)
        net = ReluNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with ProbeSession(
            net, optimizer=opt, run=Run(tmp_path / str(probes)), probing=ProbeSettings(**NO_WANDB)
        ) as s:
            if probes:
                s.add_training_hook("body", attach_relu_activation_hooks(), schedule=per_epoch(2))
                s.add_training_backward_hook("body", attach_fisher_information_hooks())
            for epoch in range(3):
                s.set_phase("train")
                for batch in minibatches(make_data(48, seed=epoch), 8):
                    opt.zero_grad()
                    F.cross_entropy(net(batch["obs"]), batch["act"]).backward()
                    opt.step()
                    torch.rand(1)  # the loop draws from the global RNG between passes
                s.epoch_end(step=epoch)
        return [p.detach().clone() for p in net.parameters()] + [torch.rand(2)]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_standard_error_of_a_proportion():
    assert standard_error(0.25, 300) == pytest.approx((0.25 * 0.75 / 300) ** 0.5)
    assert standard_error(0.5, 0) == 0.0


def test_bad_schedules_and_budgets_are_rejected(tmp_path):
    for bad, msg in [
        (lambda: every_k(0), r"every_k\(k\): k must be an integer >= 1, got 0"),
        (lambda: per_epoch(-2), r"per_epoch\(n\): n must be an integer >= 1"),
        (lambda: probe_batch(0), r"probe_batch\(rows\): rows must be an integer >= 1"),
        (lambda: as_schedule("every_k:0"), r"every_k\(k\): k must be an integer >= 1"),
        (lambda: as_schedule("sometimes"), r"schedule must be a Schedule .* got 'sometimes'"),
        (lambda: attach_relu_activation_hooks().place(schedule="every_k"), "every_k:<k>"),
        (
            lambda: ProbeCallback(probing=ProbeSettings(probe_budget=1.0)),
            "strictly between 0 and 1",
        ),
    ]:
        with pytest.raises(ValueError, match=msg):
            bad()
    for budget in (0, 0.0, -0.1, 1, 1.5, True):
        with pytest.raises(
            ValueError, match=r"probe_budget is a fraction .* strictly between 0 and 1"
        ):
            ProbeSession(
                ReluNet(),
                run=Run(tmp_path / "x"),
                probing=ProbeSettings(probe_budget=budget, **NO_WANDB),
            )
    from trainers import TrainTool

    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        TrainTool(probe_budget=1.5)
    with pytest.raises(ValueError, match=r"every_k\(k\): k must be an integer >= 1"):
        TrainTool(probe_schedule="every_k:0")
    assert TrainTool(probe_schedule="every_k:4").probe_schedule == "every_k:4"
    assert as_schedule("every") == every() and as_schedule(None) is None
    assert str(as_schedule("probe_batch:64")) == "probe_batch:64"


def test_a_probe_batch_larger_than_the_data_is_rejected(tmp_path):
    net = ReluNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ProbeSession(
        net,
        optimizer=opt,
        loss_fn=loss_fn,
        run=Run(tmp_path),
        probing=ProbeSettings(probe_schedule="probe_batch:100", **NO_WANDB),
    ) as s:
        s.add_training_hook("body", attach_relu_activation_hooks())
        s.set_data(data=make_data(40), minibatch_size=8)
        with pytest.raises(
            ValueError,
            match=r"probe_batch\(100\) asks for more rows than this epoch's data holds \(40\)",
        ):
            s.epoch_end(step=40)


def test_probe_batch_in_the_built_in_trainer_changes_nothing(tmp_path):
    """TrainTool: the probe batch is drawn from the rollout through the trainer's own
    loss (PPOModelDataContext.rows); the run's losses are the same as without probes."""
    from trainers import TrainTool

    def run(probes: bool) -> dict:
        tool = TrainTool(
            run_dir=tmp_path / str(probes),
            env={"num_envs": 2},
            policy={"activation": "relu", "hidden_sizes": [16, 16]},
            trainer={"total_timesteps": 2 * 16 * 3, "num_steps": 16, "num_minibatches": 2},
            evaluation={"every_epochs": 0, "at_end": False},
            checkpoint={"every_epochs": 0, "at_end": False},
            sinks={"console": False, "csv": False, "wandb": False},
            wandb={"mode": "disabled"},
            seed=3,
            torch_threads=1,
            probe_schedule="probe_batch:12",
        )
        if probes:
            tool.add_training_hook("actor_mlp", attach_relu_activation_hooks())
            tool.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
        return tool.invoke().metrics

    plain, probed = run(False), run(True)
    train = [k for k in plain if k.startswith("train/")]
    assert train and all(plain[k] == probed[k] for k in train)
    assert probed["probes/relu/actor_mlp/samples"] == 12
    assert probed["probes/fisher/actor_mlp/passes_observed"] == 1
    assert "probes/errors/probe_batch" not in probed


def test_sampler_state_continues_in_a_new_process():
    """A checkpoint's sampler state: the resumed sampler observes the passes the
    uninterrupted one would, and keeps the epoch's observed passes and rows."""
    from policy_probes import ComponentContext, PolicyAutoBuilder
    from policy_probes.sampling import Sampler

    def start() -> tuple[PolicyAutoBuilder, Sampler]:
        policy = PolicyAutoBuilder.wrap(ReluNet())
        context = ComponentContext()
        sampler = Sampler(context, schedule="every_k:3", budget=None)
        policy.attach("body", attach_relu_activation_hooks(), context, per_layer=False)
        return policy, sampler

    x = torch.randn(4, 5)

    def passes(policy: PolicyAutoBuilder, sampler: Sampler, n: int) -> list[bool]:
        armed = []
        for _ in range(n):
            armed.append(policy.hooks_installed())
            policy(x)
            sampler.next_pass()
        return armed

    policy, sampler = start()
    assert passes(policy, sampler, 4) == [True, False, False, True]
    state = sampler.state_dict()
    resumed_policy, resumed = start()
    resumed.load_state_dict(state)
    assert passes(resumed_policy, resumed, 4) == [False, False, True, False]  # passes 4-7
    assert resumed.totals() == {"relu/body": (3, 12)}
