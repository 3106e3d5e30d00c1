"""Probes on policies compiled with torch.compile (docs/compile.md).

Compile backends: these tests use ``backend="eager"`` (dynamo captures graphs, runs them
with the eager kernels) and ``"aot_eager"`` (plus AOTAutograd's joint forward/backward
graph), not inductor: inductor's C++ code generation takes tens of seconds per graph on
a 2-core machine, past the suite's budget. Inductor runs in
``benchmarks/compile_overhead.py``. What the probes see does not depend on the backend:
observed passes run eagerly (the ``force_eager`` stance), so metrics are compared with an
eager run at a relative tolerance of 1e-5 (float32 rounding of the compiled graph's
unobserved passes; the backends here reproduce eager to that tolerance or exactly).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import NO_WANDB, sb3_cartpole
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from policy_probes import (
    PolicyAutoBuilder,
    ProbeError,
    ProbeSettings,
    ReLUActivation,
    Run,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.compiled import check_compiled, eager_held
from policy_probes.session import ProbeSession
from recipes.cartpole import train as cartpole
from trainers import PPOConfig, TrainerHook

RTOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    assert not eager_held()  # every session gave the stance back


class Agent(nn.Module):
    """The issue's agent: an MLP under ``actor``."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(
            nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.actor(x)


def session_run(tmp_path, compile_as: str | None, budget=None, schedule=None, passes=6):
    """The issue's loop: ReLU and Fisher probes on ``actor``, ``passes`` optimizer steps
    per epoch for 2 epochs; returns the two records and the compile counter."""
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.SGD(agent.parameters(), lr=0.1)
    counter = CompileCounterWithBackend("aot_eager")
    fwd = agent
    if compile_as == "module":
        fwd = torch.compile(agent, backend=counter)
    elif compile_as == "forward":
        agent.forward = torch.compile(agent.forward, backend=counter)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(fwd(x), y).backward()
        opt.step()

    if compile_as == "step":  # the whole update (forward, backward, optimizer) as in LeanRL
        step = torch.compile(step, backend=counter)
    gen = torch.Generator().manual_seed(1)
    records = []
    with ProbeSession(
        agent,
        optimizer=opt,
        run=Run(tmp_path / str(compile_as)),
        probing=ProbeSettings(probe_budget=budget, probe_schedule=schedule, **NO_WANDB),
    ) as s:
        s.add_training_hook("actor", attach_relu_activation_hooks())
        s.add_training_backward_hook("actor", attach_fisher_information_hooks())
        for epoch in range(2):
            for _ in range(passes):
                x = torch.randn(32, 4, generator=gen)
                step(x, torch.randint(0, 3, (32,), generator=gen))
            records.append(s.epoch_end(step=epoch))
    return records, counter, agent


def assert_records_close(a: dict, b: dict, rtol: float = RTOL) -> None:
    keys = sorted(k for k in a if k.startswith("probes/") and "overhead" not in k)
    assert keys and keys == sorted(k for k in b if k.startswith("probes/") and "overhead" not in k)
    for k in keys:
        x, y = (
            torch.as_tensor(a[k], dtype=torch.float64),
            torch.as_tensor(b[k], dtype=torch.float64),
        )
        assert torch.allclose(x, y, rtol=rtol, atol=1e-9, equal_nan=True), (k, a[k], b[k])


@pytest.mark.parametrize("schedule", [None, "every_k:2"])
@pytest.mark.parametrize("compile_as", ["module", "forward", "step"])
def test_issue_repro_metrics_match_eager(tmp_path, compile_as, schedule):
    """The issue's script with the module, its forward, or the whole step compiled: every
    probe metric of every epoch equals the eager run's; the parameters too. Observing
    every pass (the issue's probe_budget=None), every pass runs eagerly and nothing is
    compiled; observing every second pass, the others run one compiled frame."""
    eager, _, eager_agent = session_run(tmp_path, None, schedule=schedule)
    compiled, counter, agent = session_run(tmp_path, compile_as, schedule=schedule)
    # a compiled step breaks its graph once, at the sampler's optimizer step hook (which
    # ends the pass and must run in Python): two frames
    assert counter.frame_count == (0 if schedule is None else 1 + (compile_as == "step"))
    for a, b in zip(compiled, eager, strict=True):
        assert_records_close(a, b)
        assert a["probes/fisher/actor/passes_observed"] == (6 if schedule is None else 3)
    for p, q in zip(agent.parameters(), eager_agent.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7)


def test_unobserved_passes_run_the_compiled_graph_without_recompiles(tmp_path):
    """every_k:3: a third of the passes run eagerly with the probes, the rest run the one
    compiled graph; arming and disarming 8 times compiles nothing more than a run without
    probes would (one frame, no graph break), and the observed passes' metrics equal the
    eager run's (which observes the same passes)."""
    eager, _, _ = session_run(tmp_path, None, schedule="every_k:3")
    compiled, counter, _ = session_run(tmp_path, "module", schedule="every_k:3")
    assert counter.frame_count == 1
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(compiled, eager, strict=True):
        assert_records_close(a, b)
    assert [r["probes/relu/actor/passes_observed"] for r in compiled] == [2, 2]


def test_a_failing_probe_under_compile_is_disabled_and_training_goes_on(tmp_path):
    """A probe that raises inside a compiled policy's observed pass is disabled and reported
    (probe_errors); the other probe and the compiled training keep running."""
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.SGD(agent.parameters(), lr=0.1)
    fwd = torch.compile(agent, backend="aot_eager")

    class Broken(ReLUActivation):
        def record(self, obs, module, output, weight) -> None:
            raise ZeroDivisionError("division by zero")  # a fault inside the probe's body

    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    with ProbeSession(
        agent,
        optimizer=opt,
        run=Run(tmp_path),
        probing=ProbeSettings(probe_budget=None, **NO_WANDB),
    ) as s:
        s.add_training_hook("actor", Broken())
        s.add_training_backward_hook("actor", attach_fisher_information_hooks())
        before = agent.actor[0].weight.detach().clone()
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(fwd(x), y).backward()
            opt.step()
        record = s.epoch_end(step=0)
        errors = dict(s.context.probe_errors)
    assert list(errors) == ["relu/actor"] and "ZeroDivisionError" in errors["relu/actor"]
    assert record["probes/fisher/actor/passes_observed"] == 4
    assert not torch.equal(before, agent.actor[0].weight)


def test_a_stance_overridden_by_the_loop_does_not_stop_training(tmp_path, caplog):
    """The unsupported case: the loop runs compiled code under its own
    set_stance("default") while probes are armed, so dynamo traces the probes' hooks.
    Training goes on (the issue's crash is gone), the forward probe still counts the
    passes, and the backward probe, whose gradient taps cannot be traced, says it missed
    them (a warning) instead of reporting metrics it did not measure."""
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.SGD(agent.parameters(), lr=0.1)
    fwd = torch.compile(agent, backend="aot_eager")
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    with ProbeSession(
        agent,
        optimizer=opt,
        run=Run(tmp_path),
        probing=ProbeSettings(probe_budget=None, **NO_WANDB),
    ) as s:
        s.add_training_hook("actor", attach_relu_activation_hooks())
        s.add_training_backward_hook("actor", attach_fisher_information_hooks())
        before = agent.actor[0].weight.detach().clone()
        for _ in range(3):
            with torch.compiler.set_stance("default"):
                opt.zero_grad()
                F.cross_entropy(fwd(x), y).backward()
                opt.step()
        record = s.epoch_end(step=0)
    assert not torch.equal(before, agent.actor[0].weight)
    assert record["probes/relu/actor/passes_observed"] == 3
    assert "probes/fisher/actor/passes_observed" not in record
    assert "gradient tap is inside code torch.compile is compiling" in caplog.text


def test_cuda_graph_modes_are_refused_at_attach(tmp_path):
    agent = Agent()
    compiled = torch.compile(agent, mode="reduce-overhead")
    with pytest.raises(ProbeError, match="CUDA graphs.*max-autotune-no-cudagraphs"):
        check_compiled(compiled)
    with ProbeSession(
        compiled, run=Run(tmp_path), probing=ProbeSettings(probe_budget=None, **NO_WANDB)
    ) as s:
        assert s.component_names[0] == "actor"  # the compiled wrapper is unwrapped
    policy = PolicyAutoBuilder.wrap(Agent())
    with ProbeSession(
        torch.compile(policy), run=Run(tmp_path / "p"), probing=ProbeSettings(**NO_WANDB)
    ) as s:
        assert s.policy is policy  # a compiled PolicyAutoBuilder is used as is
    holder = nn.Module()
    holder.policy = compiled
    with (
        ProbeSession(
            holder, run=Run(tmp_path / "h"), probing=ProbeSettings(probe_budget=None, **NO_WANDB)
        ) as s,
        pytest.raises(ProbeError, match="reduce-overhead"),
    ):
        s.add_training_hook("policy", attach_relu_activation_hooks())
    check_compiled(torch.compile(agent, mode="max-autotune-no-cudagraphs"))  # accepted
    agent.actor.compile(mode="reduce-overhead")  # compiled in place
    with pytest.raises(ProbeError, match=r"CUDA graphs \(actor\)"):
        check_compiled(agent)
    step = torch.compile(lambda x: x, mode="max-autotune")  # a compiled function
    with pytest.raises(ProbeError, match="CUDA graphs"):
        check_compiled(nn.Linear(1, 1), step)


def test_trainer_refuses_cuda_graph_modes():
    with pytest.raises(ValueError, match="compile_mode=reduce-overhead records CUDA graphs"):
        PPOConfig(compile=True, compile_mode="reduce-overhead")


class Records(TrainerHook):
    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_epoch_end(self, state) -> None:
        self.records.append(dict(state.probe_metrics))


def trainer_run(tmp_path, name, recipe=cartpole, epochs=4, schedule="per_epoch:3", **trainer):
    tool = recipe()
    records = Records()
    tool.add_trainer_hook(records)
    tool = tool.model_copy(
        update={
            "run_dir": tmp_path / name,
            "trainer": tool.trainer.model_copy(
                update={"total_timesteps": 512 * epochs, "update_epochs": 2, **trainer}
            ),
            "wandb": tool.wandb.model_copy(update={"mode": "disabled"}),
            "sinks": tool.sinks.model_copy(update={"console": False}),
            "evaluation": tool.evaluation.model_copy(update={"every_epochs": 0, "at_end": False}),
        }
    )
    tool.probe_schedule = schedule
    result = tool.invoke()
    return records.records, result


def test_trainer_compile_every_builtin_probe_matches_eager(tmp_path):
    """trainer.compile=true with the cartpole recipe's four probes on both MLPs plus a
    saturation probe: every probe metric of every epoch equals the eager run of the same
    seed (rtol 1e-5), with the per_epoch:3 schedule so both runs observe the same passes."""
    from recipes.cartpole import PROBED

    def recipe():
        tool = cartpole()
        for component in PROBED:
            tool.add_training_hook(
                f"{component}.layer_0", attach_saturated_activation_hooks("tanh")
            )
        return tool

    eager, _ = trainer_run(tmp_path, "eager", recipe)
    compiled, result = trainer_run(
        tmp_path, "compiled", recipe, compile=True, compile_backend="aot_eager"
    )
    assert not result.hook_errors
    probes = {k.split("/")[1] for k in compiled[0] if k.startswith("probes/") and k.count("/") > 2}
    assert probes == {"relu", "fisher", "gradient_flow", "relu_gradient_flow", "saturation_tanh"}
    assert len(compiled) == len(eager) == 4
    for a, b in zip(compiled, eager, strict=True):
        assert_records_close(a, b)
    assert counters["stats"]["unique_graphs"] >= 1  # the update's forward was compiled


def without_probes():
    tool = cartpole()
    object.__setattr__(tool, "__pydantic_private__", {**tool.__pydantic_private__, "_builders": []})
    return tool


def test_trainer_compile_recompiles_bounded_over_20_epochs(tmp_path):
    """20 epochs at the default (budgeted) schedule with trainer.compile=true: the probes
    cause no graph break and no compile beyond those of the same run without probes
    (recompiles there come from minibatch shapes: the autoreset steps are left out of the
    batch); the bound over the run is 3 compiled graphs."""
    kw = dict(epochs=20, schedule=None, compile=True, compile_backend="eager", update_epochs=1)
    records, _ = trainer_run(tmp_path, "probes", **kw)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    counters.clear()
    trainer_run(tmp_path, "bare", without_probes, **kw)
    assert len(records) == 20
    observed = sum(r.get("probes/relu/actor_mlp/passes_observed", 0) for r in records)
    assert 0 < observed < 20 * 4  # the sampler observed some passes, not all
    assert breaks == 0 == sum(counters["graph_break"].values())
    assert 1 <= graphs <= counters["stats"]["unique_graphs"] <= 3
    assert math.isfinite(records[-1]["probes/fisher/actor_mlp/trace"])


@pytest.mark.parametrize("how", ["evaluate_actions", "mlp_extractor"])
def test_sb3_with_a_compiled_policy_matches_eager(tmp_path, how):
    """SB3 PPO with its ``evaluate_actions`` or its ``mlp_extractor`` compiled, probed by
    ProbeCallback (every second pass observed): every cycle's probe metrics equal the eager
    run's (rtol 1e-5), and the probes add no compiled graph to the run without them."""
    from policy_probes.integrations.sb3 import ProbeCallback

    def learn(compiled: bool, probes: bool) -> list[dict]:
        torch._dynamo.reset()
        counters.clear()
        model = sb3_cartpole(
            n_steps=64, batch_size=64, n_epochs=2, hidden=(16, 16), activation_fn=nn.ReLU
        )
        if compiled and how == "evaluate_actions":
            policy = model.policy
            policy.evaluate_actions = torch.compile(policy.evaluate_actions, backend="aot_eager")
        elif compiled:
            model.policy.mlp_extractor = torch.compile(
                model.policy.mlp_extractor, backend="aot_eager"
            )
        callback = ProbeCallback(
            probes=[("actor_mlp", attach_relu_activation_hooks())],
            backward_probes=[("actor_mlp", attach_fisher_information_hooks())],
            run_dir=tmp_path / f"{compiled}-{probes}",
            probing=ProbeSettings(probe_budget=None, probe_schedule="every_k:2", **NO_WANDB),
        )
        model.learn(3 * 128, callback=callback if probes else None)
        return callback.history

    eager = learn(False, True)
    learn(True, False)
    bare_graphs = counters["stats"]["unique_graphs"]
    compiled = learn(True, True)
    assert 1 <= counters["stats"]["unique_graphs"] == bare_graphs
    assert sum(counters["graph_break"].values()) == 0
    assert len(compiled) == len(eager) == 3
    for a, b in zip(compiled, eager, strict=True):
        assert_records_close(a, b)
        assert a["probes/fisher/actor_mlp/passes_observed"] == 2  # of 4 passes per cycle


def test_a_policy_released_while_another_traces_leaves_dynamo_compiling() -> None:
    """An armed policy's claim on ``force_eager`` given back while another policy traces
    its outputs (a collected policy's finalizer can run inside that forward) must not
    leave the stance set for the process: later compiled code compiles again."""
    from policy_probes.compiled import hold_eager

    class Owner:
        pass

    class Traced(PolicyAutoBuilder):
        def __init__(self) -> None:
            super().__init__({"mlp": nn.Sequential(nn.Linear(3, 3), nn.ReLU())})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.get_component("mlp")(x)

    armed = Owner()
    hold_eager(armed, True)
    tracing = Traced()
    tracing.get_component("mlp").register_forward_hook(lambda *_: hold_eager(armed, False))
    tracing.trace_outputs(torch.ones(2, 3))
    assert not eager_held()
    counter = CompileCounterWithBackend("eager")
    torch.compile(lambda x: x * 2 + 1, backend=counter)(torch.ones(3))
    assert counter.frame_count == 1
