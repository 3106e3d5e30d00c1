"""One per-sample factor for every layer of a sequence loss (issue 26, item 7).

A loss averaged over the B x T steps of B sequences, ``L = (1/BT) sum_bt l_bt``: the
per-sample gradient of a sequence is ``BT`` times the sum over its steps of the autograd
gradient, and of a step ``BT`` times its own. The LSTM (generic route, one sample per
sequence) and the Linear read on its steps (one sample per step) must both use
``f = BT``, with no row mask, with an all-ones ``(B, T)`` mask and with ``loss_samples``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import float32_rtol
from torch import nn

from policy_probes import ComponentContext, PolicyAutoBuilder, attach_fisher_information_hooks

B, T, IN, H, C = 4, 5, 5, 8, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core = nn.Sequential()  # the component: an LSTM and a Linear on its steps
        self.core.lstm = nn.LSTM(IN, H, batch_first=True)
        self.core.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core.head(self.core.lstm(x)[0])


def data(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded minibatch, drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(3)
    x, a = torch.randn(B, T, IN, generator=g), torch.randint(0, C, (B, T), generator=g)
    return x.to(device), a.to(device)


def probed(
    net: Net,
    mask: torch.Tensor | None,
    stated: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    x, a = data(device)
    policy = PolicyAutoBuilder.wrap(net, {"core": "core"})
    ctx = ComponentContext()
    policy.attach("core", attach_fisher_information_hooks(), ctx, backward=True)
    ctx.row_mask = mask
    ctx.loss_samples = B * T if stated else None
    F.cross_entropy(net(x).reshape(-1, C), a.reshape(-1)).backward()  # mean over B x T
    ctx.row_mask = ctx.loss_samples = None
    fisher = ctx.model_metrics["fisher"].param_fisher("core")
    policy.remove_hooks()
    assert not ctx.probe_errors
    return fisher


def reference(net: Net, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """LSTM: mean over sequences of the squared gradient of the sequence's summed loss
    (one autograd call per sequence); Linear: mean over steps of the squared gradient of
    the step's loss (one autograd call per step). On ``device``, the model's."""
    x, a = data(device)
    out: dict[str, torch.Tensor] = {}
    lstm = dict(net.core.lstm.named_parameters())
    for b in range(B):
        loss = F.cross_entropy(net(x[b : b + 1])[0], a[b], reduction="sum")
        grads = torch.autograd.grad(loss, list(lstm.values()))
        for k, g in zip(lstm, grads, strict=True):
            out[f"lstm.{k}"] = out.get(f"lstm.{k}", 0) + g.double().square() / B
    head = dict(net.core.head.named_parameters())
    for b in range(B):
        for t in range(T):
            loss = F.cross_entropy(net(x[b : b + 1])[0, t], a[b, t])
            grads = torch.autograd.grad(loss, list(head.values()))
            for k, g in zip(head, grads, strict=True):
                out[f"head.{k}"] = out.get(f"head.{k}", 0) + g.double().square() / (B * T)
    return out


@pytest.mark.parametrize("how", ["no mask", "all-ones (B, T) mask", "loss_samples"])
def test_lstm_and_linear_fisher_use_one_factor_and_match_per_sample_loops(
    how: str, device: torch.device
) -> None:
    torch.manual_seed(0)
    net = Net().to(device)
    mask = torch.ones(B, T).to(device) if how == "all-ones (B, T) mask" else None
    got = probed(net, mask, stated=how == "loss_samples", device=device)
    ref = reference(net, device)
    assert set(got) == set(ref)
    for name, value in ref.items():
        rtol = float32_rtol(net)
        torch.testing.assert_close(got[name].cpu().double(), value.cpu(), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_fisher_attached_to_the_lstm_alone_matches_the_per_sequence_loop(
    masked: bool, device: torch.device
) -> None:
    """The issue's repro: the probe on the LSTM only (its output read by the default
    recurrent extractor); no mask and an all-ones (B, T) mask give the same values."""
    torch.manual_seed(0)
    net = Net().to(device)
    x, a = data(device)
    policy = PolicyAutoBuilder.wrap(net, {"lstm": "core.lstm"})
    ctx = ComponentContext()
    policy.attach("lstm", attach_fisher_information_hooks(), ctx, backward=True)
    ctx.row_mask = torch.ones(B, T).to(device) if masked else None
    F.cross_entropy(net(x).reshape(-1, C), a.reshape(-1)).backward()
    ctx.row_mask = None
    got = ctx.model_metrics["fisher"].param_fisher("lstm")
    policy.remove_hooks()
    assert not ctx.probe_errors
    ref = {
        k.removeprefix("lstm."): v
        for k, v in reference(net, device).items()
        if k.startswith("lstm.")
    }
    assert set(got) == set(ref)
    for name, value in ref.items():
        rtol = float32_rtol(net)
        torch.testing.assert_close(got[name].cpu().double(), value.cpu(), rtol=rtol, atol=1e-12)
