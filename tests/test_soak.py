"""Endurance: a long tiny run with every probe and every observer keeps resident memory
flat and leaves exactly one record per epoch in every metric file.

CI runs a short version (SOAK_EPOCHS, default 300); the full soak is
``SOAK_EPOCHS=1000 pytest tests/test_soak.py`` (also ``-m slow`` selects it).
"""

from __future__ import annotations

import csv
import gc
import json
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from policy_probes.sinks import SinksConfig, WandbConfig
from trainers import CheckpointConfig, EnvConfig, EvalConfig, PPOConfig, TrainerHook

EPOCHS = int(os.environ.get("SOAK_EPOCHS", "300"))
WARMUP = 50  # epochs before the baseline: allocator pools, lazy imports, buffers
RSS_BOUND_MB = 25.0


class ResidentMemory(TrainerHook):
    """Resident set size of this process after every epoch."""

    def __init__(self) -> None:
        self.rss: list[int] = []
        self.process = psutil.Process()

    def on_epoch_end(self, state: Any) -> None:
        if state.epoch % 10 == 0:
            gc.collect()
        self.rss.append(self.process.memory_info().rss)


@pytest.mark.slow
def test_long_run_memory_flat_and_one_record_per_epoch(tmp_path: Path) -> None:
    from recipes.cartpole import train

    tool = train().model_copy(
        update={
            "run_dir": tmp_path / "soak",
            "env": EnvConfig(id="CartPole-v1", num_envs=2, vectorization="vector_entry_point"),
            "trainer": PPOConfig(
                total_timesteps=16 * EPOCHS, num_steps=8, num_minibatches=2, update_epochs=1
            ),
            "evaluation": EvalConfig(every_epochs=0, at_end=False),
            "checkpoint": CheckpointConfig(every_epochs=100, keep_last=2),
            "sinks": SinksConfig(console=False, jsonl=True, csv=True, wandb=False),
            "wandb": WandbConfig(mode="disabled"),
            "with_hooks": "observers",
            "snapshot_every": 100,
            # one sampled pass in every epoch (the default budget, on 2-pass epochs, would
            # observe one every few epochs): every record carries the probe metrics
            "probe_schedule": "per_epoch:1",
        }
    )
    memory = ResidentMemory()
    tool.add_trainer_hook(memory)
    result = tool.invoke()
    assert result.epochs == EPOCHS
    assert not result.hook_errors

    baseline = max(memory.rss[WARMUP - 10 : WARMUP])
    growth_mb = (max(memory.rss[WARMUP:]) - baseline) / 2**20
    assert growth_mb < RSS_BOUND_MB, f"RSS grew by {growth_mb:.1f} MB over {EPOCHS} epochs"

    records = [json.loads(line) for line in (tmp_path / "soak" / "metrics.jsonl").open()]
    post_epoch = [r["epoch"] for r in records if r["hook_point"] == "POST_EPOCH"]
    assert post_epoch == list(range(1, EPOCHS + 1))
    # every epoch carries the probe and observer metrics, not just the trainer's own
    last = next(r for r in reversed(records) if r["hook_point"] == "POST_EPOCH")
    assert "probes/relu/actor_mlp/dead_fraction" in last
    assert any(k.startswith("norms/") for k in last)
    with (tmp_path / "soak" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["hook_point"] == "POST_EPOCH"]
    assert [int(float(r["epoch"])) for r in rows] == list(range(1, EPOCHS + 1))
