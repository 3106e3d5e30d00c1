"""The suite's ``--device`` option (tests/conftest.py, docs/cuda.md): a device the tests
cannot run on is refused before any test runs, with a message that says what to pass."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from conftest import DEVICE_VARIABLE, ROOT


def pytest_run(*args: str, device: str | None = None) -> subprocess.CompletedProcess:
    """Collect this file in a fresh pytest (the header says the device), with
    ``$POLICY_PROBES_TEST_DEVICE`` set to ``device`` or unset."""
    env = {k: v for k, v in os.environ.items() if k != DEVICE_VARIABLE}
    if device is not None:
        env[DEVICE_VARIABLE] = device
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts="]
    return subprocess.run(
        [*command, "--co", *args, "tests/test_device_option.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unknown_device_is_refused_with_the_choices() -> None:
    ran = pytest_run("--device", "meta")
    assert ran.returncode == 4  # pytest's usage error
    assert "--device meta: the tests run on cpu or cuda" in ran.stderr


def test_cuda_without_a_gpu_is_refused_and_the_variable_is_read() -> None:
    ran = pytest_run(device="cuda")
    if torch.cuda.is_available():  # a GPU machine runs the device tests on it
        assert ran.returncode == 0
        assert "policy-probes test device: cuda" in ran.stdout
    else:
        assert ran.returncode == 4
        assert "--device cuda: CUDA is not available on this machine" in ran.stderr


def test_the_default_device_is_the_cpu() -> None:
    ran = pytest_run()
    assert ran.returncode == 0
    assert "policy-probes test device: cpu" in ran.stdout
