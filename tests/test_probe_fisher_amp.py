"""The Fisher probe under mixed precision: ``torch.autocast`` with ``torch.amp.GradScaler``
(float16 on CUDA, bfloat16 on the CPU), the scale handed to the probes by
``ProbeSession.scale_loss``.

A scaled loss multiplies every gradient by the scaler's scale S, a power of two, so the
probe must divide S out of each sample's gradient, on the device and per backward (the
scale changes between steps). Two checks: against the same autocast run without a
scaler (equal to float32 rounding: scaling half-precision gradients by a power of two is
exact), and against per-sample float32 gradients from ``torch.func`` (within
half-precision rounding; a scale not divided out would be off by S**2 = 2**32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import JSONL_ONLY
from torch import nn
from torch.func import functional_call, grad, vmap

from policy_probes import PolicyAutoBuilder, attach_fisher_information_hooks
from policy_probes.probe_settings import ProbeSettings
from policy_probes.session import ProbeSession

#: the scales of the two backward passes (the scaler is told the second one in between)
SCALES = (2.0**16, 2.0**12)


def half_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def make_model(device: torch.device) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Linear 6->32, ReLU, Linear 32->16, ReLU (``body``), Linear 16->4 (``head``), and two
    minibatches of (observation, action), built on the CPU from fixed seeds."""
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU()),
        nn.Linear(16, 4),
    )
    g = torch.Generator().manual_seed(11)
    batches = [
        (torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (24, 17)
    ]
    return net.to(device), [(x.to(device), a.to(device)) for x, a in batches]


def probed_fisher(tmp_path: Path, device: torch.device, *, scaled: bool) -> dict[str, torch.Tensor]:
    """Per-entry Fisher of ``body`` after one autocast backward per minibatch, with the
    loss scaled by a GradScaler (``scaled``) or not."""
    net, batches = make_model(device)
    model = PolicyAutoBuilder.wrap(
        net, {"body": "0", "head": "1"}, example_inputs=(torch.zeros(1, 6, device=device),)
    )
    probing = ProbeSettings(sinks=JSONL_ONLY, probe_budget=None)
    session = ProbeSession(model, run=tmp_path / ("scaled" if scaled else "plain"), probing=probing)
    session.add_training_backward_hook("body", attach_fisher_information_hooks())
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALES[0])
    for i, (x, a) in enumerate(batches):
        with torch.autocast(device.type, dtype=half_dtype(device)):
            loss = F.cross_entropy(model(x), a)
        if scaled:
            if i > 0:
                scaler.update(new_scale=SCALES[i])
            session.scale_loss(loss, scaler).backward()
            assert float(session.context.loss_scale) == SCALES[i]
        else:
            loss.backward()
    fisher = session.context.model_metrics["fisher"].param_fisher("body")
    session.close()
    return fisher


def reference_fisher(device: torch.device) -> dict[str, torch.Tensor]:
    """Mean over both minibatches' samples of each squared per-sample gradient of the
    cross-entropy, in float32 without autocast (``vmap`` of ``grad``)."""
    net, batches = make_model(device)
    body, head = net[0], net[1]
    params = {k: v.detach() for k, v in body.named_parameters()}
    head.requires_grad_(False)

    def loss_one(p: dict, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(functional_call(body, p, (x[None],))), a[None])

    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    n = 0
    for x, a in batches:
        for k, g in vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, a).items():
            total[k] += (g.double() ** 2).sum(0)
        n += x.shape[0]
    return {k: v / n for k, v in total.items()}


def test_grad_scaler_scale_is_divided_out_exactly(tmp_path: Path, device: torch.device) -> None:
    scaled = probed_fisher(tmp_path, device, scaled=True)
    plain = probed_fisher(tmp_path, device, scaled=False)
    assert set(scaled) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, value in plain.items():
        assert value.abs().sum() > 0, name
        # atol: float16 gradients below 2**-14 are subnormal without the scale (coarser)
        atol = 1e-6 * float(value.abs().max())
        torch.testing.assert_close(scaled[name], value, rtol=1e-6, atol=atol, msg=name)


def test_grad_scaler_fisher_matches_float32_per_sample_gradients(
    tmp_path: Path, device: torch.device
) -> None:
    got = probed_fisher(tmp_path, device, scaled=True)
    ref = reference_fisher(device)
    # A half-precision forward rounds each entry by a few parts in 1e3 (bfloat16 on the
    # CPU: ~0.5 % median here, traces within 2 %); a pre-activation near 0 can flip its ReLU
    # for one sample, so single entries can differ more and the check is on each
    # parameter's trace and on the median entry.
    tol = 2e-2 if half_dtype(device) == torch.float16 else 5e-2
    for name, value in ref.items():
        g = got[name].double()
        r = value.cpu()
        assert float(g.sum()) == pytest.approx(float(r.sum()), rel=tol), name
        rel = (g - r).abs() / r.abs().clamp_min(1e-12)
        assert float(rel.median()) < tol / 4, name
