"""A pass inside a ``torch.func`` transform (TorchRL's vmapped value estimate, per-sample
gradients with ``vmap(grad(...))``) is not recorded, and it neither disables a probe nor
stops the epoch's report: the record equals the one the plain passes alone give."""

from __future__ import annotations

import logging

import torch
from torch import nn

from policy_probes import (
    ProbeSettings,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
)
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig


def _session(tmp_path, name: str) -> tuple[ProbeSession, nn.Sequential]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    settings = ProbeSettings(
        sinks=SinksConfig(console=False, wandb=False),
        wandb=WandbConfig(mode="disabled"),
        probe_budget=None,
    )
    session = ProbeSession(
        nn.ModuleDict({"mlp": mlp}),
        components={"mlp": "mlp"},
        run=tmp_path / name,
        probing=settings,
    )
    # no rollout handed over: no reference states to score on
    session.add_training_hook("mlp", attach_relu_activation_hooks(reference=False))
    session.add_training_backward_hook("mlp", attach_fisher_information_hooks())
    session.set_phase("train")
    return session, mlp


def _train_pass(mlp: nn.Sequential, x: torch.Tensor) -> None:
    mlp(x).logsumexp(-1).mean().backward()


def test_passes_inside_vmap_and_grad_are_left_out_of_the_record(tmp_path, caplog) -> None:
    g = torch.Generator().manual_seed(1)
    x, batched = torch.randn(16, 4, generator=g), torch.randn(3, 5, 4, generator=g)

    plain, mlp = _session(tmp_path, "plain")
    with plain:
        _train_pass(mlp, x)
        expected = plain.epoch_end(step=1)

    session, mlp = _session(tmp_path, "transformed")
    with caplog.at_level(logging.WARNING, logger="policy_probes"), session:
        with torch.no_grad():
            torch.vmap(mlp)(batched)  # a vmapped value estimate
        params = dict(mlp.named_parameters())

        def loss(p: dict, row: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(mlp, p, (row,)).logsumexp(-1)

        torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)  # per-sample grads
        _train_pass(mlp, x)
        got = session.epoch_end(step=1)
    assert not [k for k in got if k.startswith("probes/errors")]
    for key in (
        "probes/relu/mlp/dead_fraction",
        "probes/relu/mlp/active_rate",
        "probes/relu/mlp/samples",
        "probes/fisher/mlp/trace",
        "probes/fisher/mlp/unit",
    ):
        assert got[key] == expected[key], key
    assert got["probes/relu/mlp/samples"] == 16
    assert any("torch.func transform" in r.getMessage() for r in caplog.records)
