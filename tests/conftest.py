"""Shared fixtures: tiny probe-able policies, a clean torch setup, the built-in probes'
builders, what tests recompute by hand (saturation from a layer's outputs, the seeds a
remedy draws, snapshots of weights and moments) and the CLI run as a subprocess."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from policy_probes import (
    ComponentContext,
    LinearSpec,
    MLPSpec,
    PolicyAutoBuilder,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.cli import main
from policy_probes.probe_settings import ProbeSettings
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig
from policy_probes.torch_internals import module_hook_count

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)

#: tests that need another venv: ``make test`` runs them there (tests/test_rllib.py in
#: ``.venv-rllib``, whose ray[rllib] pins its own gymnasium); a venv without ray leaves them
#: out here, it does not skip them
collect_ignore = [] if importlib.util.find_spec("ray") else ["test_rllib.py"]


def cli_error_line(capsys: pytest.CaptureFixture, *args: str) -> str:
    """``policy-probes ARGS`` in-process must exit 2 with one ``error:`` line and no
    traceback; returns that line."""
    capsys.readouterr()
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("policy-probes")]
    assert len(lines) == 1, err
    return lines[0]


#: where the tests that take a ``device`` run: ``pytest --device cuda`` or
#: ``POLICY_PROBES_TEST_DEVICE=cuda``; every other test runs on the CPU either way
DEVICE_VARIABLE = "POLICY_PROBES_TEST_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help=f"torch device of the tests that take one (cpu or cuda; default ${DEVICE_VARIABLE} "
        "or cpu)",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--device") or os.environ.get(DEVICE_VARIABLE) or "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--device {name}: CUDA is not available on this machine")
        # The tests check formulas and bit-identical trajectories, not TF32 speed:
        # float32 matrix products and convolutions in full precision, deterministic
        # kernels (cuBLAS reads its workspace setting when its first handle is made).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    elif device.type != "cpu":
        raise pytest.UsageError(f"--device {name}: the tests run on cpu or cuda")
    config.test_device = device


def pytest_report_header(config: pytest.Config) -> str:
    return f"policy-probes test device: {config.test_device}"


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device of a test that takes one (``--device``; the CPU by default). Such a test
    builds its model and inputs as before, on the CPU with the same seeds, then moves
    them here, so its numbers and tolerances hold on every device."""
    return request.config.test_device


class TinyPolicy(PolicyAutoBuilder):
    """actor_mlp -> actor_head, the layout of the built-in policies, small enough for
    exact reference computations."""

    def __init__(
        self, obs: int = 5, hidden: tuple[int, ...] = (7, 6), act: int = 3, activation: str = "relu"
    ):
        super().__init__(
            {
                "actor_mlp": MLPSpec(
                    in_features=obs, hidden_sizes=list(hidden), activation=activation
                ),
                "actor_head": LinearSpec(in_features=hidden[-1], out_features=act),
            }
        )
        self.trace_outputs(torch.zeros(1, obs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.actor_head(self.actor_mlp(x))


class ReluNet(nn.Module):
    """A plain torch model (no PolicyAutoBuilder): ``body`` = Linear 5->16, ReLU,
    Linear 16->12, ReLU, and ``head`` = Linear 12->3, the consumer of its last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU())
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def float32_rtol(model: nn.Module, rtol: float = 1e-5) -> float:
    """``rtol`` for comparing a probe's float32 value with a reference computed another way
    on ``model``'s device. On CUDA a model with a recurrent layer gets 1e-4: cuDNN's
    recurrent kernels (the probed forward) and the native cells (``vmap``, one-sample
    loops) round differently, up to 3e-5 relative (measured on an H200), where the CPU
    runs the same kernels both ways."""
    recurrent = any(isinstance(m, (nn.RNNBase, nn.RNNCellBase)) for m in model.modules())
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    return 1e-4 if recurrent and on_cuda else rtol


#: session / TrainTool keywords: no console and no W&B (metrics.jsonl and metrics.csv written)
NO_WANDB = dict(sinks=SinksConfig(console=False, wandb=False), wandb=WandbConfig(mode="disabled"))
#: the sinks of the remedy tests' sessions: records in metrics.jsonl only
JSONL_ONLY = SinksConfig(console=False, csv=False, wandb=False, tensorboard=False)
#: the seed the remedy tests give their remedies (what they draw: :func:`remedy_seeds`)
REMEDY_SEED = 7


def remedy_session(
    run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> ProbeSession:
    """A session for remedies on ``model`` stepped by ``optimizer``: every pass observed
    (``probe_budget=None``), records in metrics.jsonl only."""
    probing = ProbeSettings(sinks=JSONL_ONLY, probe_budget=None)
    return ProbeSession(model, run=run_dir, probing=probing, optimizer=optimizer)


def remedy_seeds(seed: int, remedy: str, component: str, n: int) -> list[int]:
    """The ``n`` seeds (one per layer) that ``remedy`` draws for ``component`` in a session
    seeded with ``seed``: its generator starts at ``seed * 1_000_003 +
    crc32("remedy@component")`` mod 2**63."""
    g = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(f"{remedy}@{component}".encode())) % 2**63
    )
    return [int(torch.randint(0, 2**62, (1,), generator=g)) for _ in range(n)]


def snapshot(
    model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Copies of every parameter and of its optimiser state, by parameter name."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
    }
    return params, state


#: factories of a builder of every built-in forward probe (saturation: tanh) and of every
#: built-in backward probe, with their defaults
ALL_FORWARD = (attach_relu_activation_hooks, lambda: attach_saturated_activation_hooks("tanh"))
ALL_BACKWARD = (
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_gradient_flow_hooks,
)


def attach_all_probes(
    policy: PolicyAutoBuilder,
    ctx: ComponentContext,
    component: str = "actor_mlp",
    *,
    saturation: str | None = None,
    saturation_component: str | None = None,
) -> None:
    """The ReLU probe, optionally a saturation probe, and the three backward probes."""
    policy.attach(component, attach_relu_activation_hooks(), ctx)
    if saturation is not None:
        policy.attach(
            saturation_component or component, attach_saturated_activation_hooks(saturation), ctx
        )
    for make in ALL_BACKWARD:
        policy.attach(component, make(), ctx, backward=True)


def sb3_cartpole(
    recurrent: bool = False,
    *,
    n_steps: int = 16,
    batch_size: int = 16,
    n_epochs: int = 1,
    hidden: tuple[int, ...] = (16,),
    n_envs: int = 2,
    seed: int = 0,
    **policy_kwargs: object,
) -> Any:
    """Stable-Baselines3's PPO (sb3-contrib's RecurrentPPO when ``recurrent``) on ``n_envs``
    CartPole envs, on the CPU, with actor and critic MLPs of ``hidden`` units;
    ``policy_kwargs`` adds to the policy's (``activation_fn``, ``lstm_hidden_size``)."""
    from stable_baselines3.common.env_util import make_vec_env

    if recurrent:
        from sb3_contrib import RecurrentPPO as algo
    else:
        from stable_baselines3 import PPO as algo
    return algo(
        "MlpLstmPolicy" if recurrent else "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=n_envs, seed=seed),
        n_steps=n_steps,
        batch_size=batch_size,
        n_epochs=n_epochs,
        policy_kwargs=dict(net_arch=dict(pi=list(hidden), vf=list(hidden)), **policy_kwargs),
        device="cpu",
        seed=seed,
    )


def saturation_reference(
    h: torch.Tensor, activation: str, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which outputs ``h`` of a tanh or sigmoid layer are saturated at ``threshold``
    (tanh: ``|h| > t``; sigmoid: ``h < 1 - t`` or ``h > t``) and the activation's
    derivative at each, from the output alone."""
    if activation == "tanh":
        return h.abs() > threshold, 1 - h**2
    return (h < 1 - threshold) | (h > threshold), h * (1 - h)


def hook_counts(model: nn.Module) -> int:
    """Number of torch hooks of every kind left on every module of ``model``."""
    return module_hook_count(model)


def cli(*args: str, cwd: Path = ROOT, **popen: object) -> subprocess.CompletedProcess:
    """``python -m policy_probes.cli ARGS`` as a user runs it (the worktree's code)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, "-m", "policy_probes.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        **popen,
    )


def seed_of_test(nodeid: str) -> int:
    """The seed a test starts from: crc32 of its node id (stable across runs, machines and
    the order tests run in; each test, and each parameter of one, gets its own numbers)."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Seed ``random``, numpy and torch (every device) before every test, so that a test
    drawing random numbers without a generator of its own draws the same ones every run.
    A test that seeds itself is unchanged (its seed comes after this one)."""
    seed = seed_of_test(request.node.nodeid)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture
def tiny_policy() -> TinyPolicy:
    torch.manual_seed(0)
    return TinyPolicy()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """The tiny run-control recipe's CLI target and the final parameters of an
    uninterrupted run (``tests/run_control_support.py``)."""
    from run_control_support import baseline_params, write_recipe

    directory = tmp_path_factory.mktemp("recipe")
    target = write_recipe(directory)
    return target, baseline_params(target, directory / "baseline")


@pytest.fixture(autouse=True)
def _no_eager_stance_across_tests():
    """A probed policy a test leaves armed holds ``force_eager`` for the whole process
    (:mod:`policy_probes.compiled`); the next test starts from the default stance."""
    yield
    from policy_probes import compiled

    if compiled._holders:
        import gc

        gc.collect()  # policies dropped while armed give their claims back
    for key in list(compiled._holders):
        compiled._release(key)
