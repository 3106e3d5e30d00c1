"""Plasticity injection (Nikishin, Oh, Ostrovski, Lyle, Pascanu, Dabney, Barreto 2023,
"Deep Reinforcement Learning with Plasticity Injection", NeurIPS).

At its firing (once: the first epoch its trigger is due) the component ``h_theta`` is
frozen and its output becomes ``h_theta(x) + h_theta'(x) - h_theta'_0(x)``, with
``theta'`` a fresh initialisation (one seed per layer) and ``theta'_0`` a frozen copy of
it: the outputs are bit-identical at the injection, and only ``theta'`` trains, with an
optimizer of the loop's class stepped right after the loop's. The sum is added by a forward
hook that runs before the component's other hooks (the probes see it). The copies and that
optimizer live in the remedy's state (checkpoints carry it). Limitations (no clipping of
``theta'``, one process, a single ``nn.Linear``): ``docs/remedies.md``."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from policy_probes.plugins import register
from policy_probes.processes import multi_process
from policy_probes.remedies.base import Remedy, RemedyOptions, RemedyTarget
from policy_probes.remedies.fresh_init import refresh_layers, resettable_leaves
from policy_probes.remedies.trigger import Threshold
from policy_probes.torch_internals import hooks_set_aside


@dataclass
class Injection:
    """The injected copy of one component, once injected."""

    layers: list[tuple[str, nn.Module]]
    target: RemedyTarget | None = None
    trainable: nn.Module | None = None
    frozen: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    handles: list[Any] = field(default_factory=list)


def hook_free_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without its modules' torch hooks and gradients."""
    with hooks_set_aside(module):
        twin = copy.deepcopy(module)
    for p in twin.parameters():
        p.grad = None
    return twin


def _optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    return {k: v for k, v in group.items() if k not in ("params", "initial_lr")}


@register
class PlasticityInjection(Remedy):
    """Plasticity injection (Nikishin et al., NeurIPS 2023): freeze the component once and
    add a fresh trainable copy minus a frozen one (build with
    :func:`plasticity_injection`)."""

    name = "plasticity_injection"

    def prepare(self, target: RemedyTarget) -> Injection:
        return Injection(resettable_leaves(self.name, target))

    def apply(
        self, target: RemedyTarget, prepared: Injection, generator: torch.Generator
    ) -> dict[str, int] | None:
        if prepared.trainable is not None:
            return None  # injects once: a later due epoch does not fire
        if multi_process():
            raise RuntimeError(
                "plasticity_injection supports single-process runs only (the injected "
                "parameters would not be all-reduced across ranks)"
            )
        trainable = hook_free_copy(target.module)
        by_name = {
            f"{target.component}.{n}" if n else target.component: m
            for n, m in trainable.named_modules()
        }
        layers = [(name, by_name[name]) for name, _ in prepared.layers]
        out = refresh_layers(layers, generator, lambda p, fresh: p.copy_(fresh))
        self._install(target, prepared, trainable, hook_free_copy(trainable))
        return out

    def _install(
        self, target: RemedyTarget, prepared: Injection, trainable: nn.Module, frozen: nn.Module
    ) -> None:
        frozen.requires_grad_(False)
        trainable.requires_grad_(True)
        target.module.requires_grad_(False)
        for p in target.module.parameters():
            p.grad = None
        prepared.trainable, prepared.frozen = trainable, frozen
        main = target.optimizer
        prepared.optimizer = type(main)(trainable.parameters(), **_optimizer_settings(main))

        def add_copy(module: nn.Module, args: Any, kwargs: Any, output: torch.Tensor) -> Any:
            return output + (trainable(*args, **kwargs) - frozen(*args, **kwargs))

        def step_copy(*_: Any) -> None:
            opt = prepared.optimizer
            opt.param_groups[0].update(_optimizer_settings(main))
            opt.step()
            opt.zero_grad(set_to_none=True)

        # first among the component's forward hooks: the probes' hooks, whenever they are
        # (re-)installed, read the injected output
        prepared.handles = [
            target.module.register_forward_hook(add_copy, with_kwargs=True, prepend=True),
            main.register_step_post_hook(step_copy),
        ]

    def state_dict(self, prepared: Injection) -> dict[str, Any]:
        if prepared.trainable is None:
            return {"injected": False}
        return {
            "injected": True,
            "trainable": prepared.trainable.state_dict(),
            "frozen": prepared.frozen.state_dict(),
            "optimizer": prepared.optimizer.state_dict(),
        }

    def load_state_dict(self, prepared: Injection, state: Any) -> None:
        if not state.get("injected") or prepared.trainable is not None:
            return
        target = prepared.target
        trainable, frozen = hook_free_copy(target.module), hook_free_copy(target.module)
        trainable.load_state_dict(state["trainable"])
        frozen.load_state_dict(state["frozen"])
        self._install(target, prepared, trainable, frozen)
        prepared.optimizer.load_state_dict(state["optimizer"])

    def start(self, target: RemedyTarget, prepared: Injection, generator: torch.Generator) -> None:
        prepared.target = target


def plasticity_injection(
    every_epochs: int | None = None,
    when: str | Threshold | None = None,
    **options: Unpack[RemedyOptions],
) -> PlasticityInjection:
    """Plasticity injection into the component it is attached to, once (module docstring)."""
    return PlasticityInjection(every_epochs=every_epochs, when=when, **options)
