"""The conv Fisher's two exact routes timed against each other on one device: the
grouped correlation (``ConvRule.squares(method="correlate")``) and the im2col contraction
(``"unfold"``) on NatureCNN's three conv layers; the default route of each device is chosen
from this measurement (docs/probes/fisher.md, "Cost"). Per layer and batch size: the
median of ``--repeats`` timed calls after two warm-ups and, on CUDA, the peak memory a
call allocates; both routes are checked to agree first.

    python -m benchmarks.fisher_conv_routes [--device cuda] [--batches 256,1024] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.ab import RESULTS, write_json
from policy_probes.probes.fisher_rules import ConvRule, chunk_bytes_for
from trainers.nature_cnn import NATURE_CONVS, conv_output_size

METHODS = ("correlate", "unfold")


def nature_layers() -> list[tuple[str, nn.Conv2d, tuple[int, int, int]]]:
    """NatureCNN's conv layers with the input shape each sees (84x84, 4 frames)."""
    layers, channels, size = [], 4, 84
    for i, (out_channels, kernel, stride) in enumerate(NATURE_CONVS):
        layers.append(
            (f"conv_{i}", nn.Conv2d(channels, out_channels, kernel, stride), (channels, size, size))
        )
        channels, size = out_channels, conv_output_size(size, kernel, stride)
    return layers


def timed(fn: Any, device: torch.device, repeats: int) -> tuple[float, int | None]:
    """Median milliseconds of ``fn()`` and (CUDA) the peak bytes one call allocates."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    peak = None
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync()
        peak = torch.cuda.max_memory_allocated(device) - before
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="256,1024")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    chunk = chunk_bytes_for(None, device)
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    for n in (int(b) for b in args.batches.split(",")):
        for name, conv, shape in nature_layers():
            conv = conv.to(device)
            x = torch.rand(n, *shape, device=device)
            out = conv(x).detach()
            g = torch.randn_like(out)
            rule = ConvRule.of(conv, ("weight", "bias"), x, out)
            xs, gs = x.reshape(n, -1), g.reshape(n, -1)
            results = {m: rule.squares(xs, gs, chunk, m) for m in METHODS}
            for key in results["unfold"]:  # both routes are exact: they agree
                torch.testing.assert_close(
                    results["correlate"][key], results["unfold"][key], rtol=1e-4, atol=1e-6
                )
            row: dict[str, Any] = {"batch": n, "layer": name}
            for m in METHODS:
                ms, peak = timed(partial(rule.squares, xs, gs, chunk, m), device, args.repeats)
                row[f"{m}_ms"] = round(ms, 3)
                if peak is not None:
                    row[f"{m}_peak_mib"] = round(peak / 2**20, 1)
            row["correlate_over_unfold"] = round(row["correlate_ms"] / row["unfold_ms"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, one thread"
    payload = {"device": name, "torch": torch.__version__, "chunk_bytes": chunk, "rows": rows}
    write_json(args.out or RESULTS / f"fisher_conv_routes_{device.type}.json", payload)


if __name__ == "__main__":
    main()
