"""Shared fixtures: tiny probe-able policies and a clean torch setup."""

from __future__ import annotations

import os

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
from policy_probes.torch_internals import module_hook_count

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)


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
    for make in (
        attach_fisher_information_hooks,
        attach_gradient_flow_hooks,
        attach_relu_gradient_flow_hooks,
    ):
        policy.attach(component, make(), ctx, backward=True)


def hook_counts(model: nn.Module) -> int:
    """Number of torch hooks of every kind left on every module of ``model``."""
    return module_hook_count(model)


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
