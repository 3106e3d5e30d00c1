"""Cost of the Fisher probe's conv rule and generic torch.func route, per training pass.

A pass is forward + backward of one minibatch (mean cross-entropy), with the probe's
reduction included (the tracker is flushed after every pass, so nothing is deferred).
Sides alternate (plain, probed, plain, ...) and the figure is the median of per-pair
ratios, one torch thread:

    python -m benchmarks.fisher_layers_cost [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from policy_probes import ComponentContext, PolicyAutoBuilder, attach_fisher_information_hooks


class LSTMPolicy(nn.Module):
    """A small recurrent policy body: (batch, time, obs) -> LSTM -> last hidden state."""

    def __init__(self, obs: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(obs, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0][:, -1]


def nature_cnn() -> nn.Module:
    """SB3's NatureCNN layout on 4 x 84 x 84 frames."""
    return nn.Sequential(
        nn.Conv2d(4, 32, 8, stride=4),
        nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
    )


def make_pass(body: nn.Module, width: int, x: torch.Tensor, probed: bool) -> Callable[[], None]:
    """One training pass of ``body`` + a 6-way linear head on ``x``, with the Fisher probe
    on ``body`` when ``probed`` (its tracker flushed after every pass)."""
    model = PolicyAutoBuilder.wrap(nn.Sequential(body, nn.Linear(width, 6)), {"body": "0"})
    ctx = ComponentContext()
    if probed:
        model.attach("body", attach_fisher_information_hooks(), ctx, backward=True)
    a = torch.randint(0, 6, (x.shape[0],))

    def one() -> None:
        F.cross_entropy(model(x), a).backward()
        for tracker in ctx.model_metrics.values():
            tracker.flush()

    return one


def seconds(step: Callable[[], None], passes: int) -> float:
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(passes):
        step()
    return (time.perf_counter() - start) / passes


def measure(
    name: str, body: Callable[[], nn.Module], width: int, x: torch.Tensor, repeats: int, passes: int
) -> dict:
    """Plain and probed passes of a new ``body()`` each, alternating, ``repeats`` pairs."""
    plain, probed = make_pass(body(), width, x, False), make_pass(body(), width, x, True)
    pairs = []
    for r in range(repeats):
        order = (plain, probed) if r % 2 == 0 else (probed, plain)
        t = {id(s): seconds(s, passes) for s in order}
        pairs.append((t[id(plain)], t[id(probed)]))
    ratio = statistics.median(b / a for a, b in pairs)
    row = {
        "case": name,
        "plain_ms": 1e3 * statistics.median(a for a, _ in pairs),
        "probed_ms": 1e3 * statistics.median(b for _, b in pairs),
        "ratio": ratio,
        "ratio_range": [min(b / a for a, b in pairs), max(b / a for a, b in pairs)],
    }
    print(
        f"{name:42s} plain {row['plain_ms']:8.2f} ms  probed {row['probed_ms']:8.2f} ms  "
        f"x{ratio:.2f} ({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fisher_layers.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    repeats, passes = (1, 2) if args.quick else (args.repeats, 5)
    rows = []
    for batch, seq, hidden in ((64, 16, 64), (256, 16, 64)):
        x = torch.randn(batch, seq, 32)
        name = f"LSTM(32->{hidden}) batch {batch} x {seq} steps"
        rows.append(measure(name, partial(LSTMPolicy, 32, hidden), hidden, x, repeats, passes))
    x = torch.rand(64, 4, 84, 84)
    cnn = "NatureCNN batch 64 (conv rule)"
    rows.append(measure(cnn, nature_cnn, 512, x, repeats, max(passes // 2, 1)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "torch": torch.__version__}
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
