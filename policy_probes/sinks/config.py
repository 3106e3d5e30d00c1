"""Configuration of the metric sinks (``sinks.*``) and of the W&B run (``wandb.*``).

Both models reject unknown fields, so ``wandb.projct=x`` on the command line fails with
the list of valid keys instead of being ignored.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policy_probes.sinks.base import FSYNC_SECONDS

#: metrics the console sink follows by default (missing ones are simply not shown)
DEFAULT_CONSOLE_METRICS: tuple[str, ...] = (
    "rollout/episode_return",
    "eval/return_mean",
    "train/policy_loss",
    "train/value_loss",
    "train/entropy",
    "train/approx_kl",
    "train/clipfrac",
    "perf/sps",
    "probes/relu/*/dead_fraction",
    "probes/relu/*/dormant_fraction",
    "probes/fisher/*/trace",
    "probes/gradient_flow/*/mean",
    "probes/relu_gradient_flow/*/mean_pass_rate",
    "probes/saturation_*/*/saturated_fraction",
)

WandbMode = Literal["online", "offline", "disabled"]


class SinksConfig(BaseModel):
    """Which outputs a run writes. All files go to ``run_dir``."""

    model_config = ConfigDict(extra="forbid")

    console: bool = Field(True, description="Rich table at each SNAPSHOT and a live trend view.")
    console_metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CONSOLE_METRICS),
        description="Keys or glob patterns ('probes/relu/*/dead_fraction') the console shows.",
    )
    console_live: bool = Field(
        True, description="Live trend view during training (only on an interactive terminal)."
    )
    jsonl: bool = Field(True, description="run_dir/metrics.jsonl, one JSON object per emit.")
    csv: bool = Field(True, description="run_dir/metrics.csv, scalars only, vectors summarised.")
    fsync_seconds: float = Field(
        FSYNC_SECONDS,
        ge=0,
        description="JSONL/CSV: at most one fsync per this many seconds at epoch ends (0: "
        "every epoch end); every record reaches the OS at once, checkpoints and close fsync.",
    )
    wandb: bool = Field(True, description="Weights & Biases run (see the wandb section for mode).")
    tensorboard: bool = Field(
        False, description="TensorBoard event files in run_dir/tensorboard (needs `tensorboard`)."
    )

    @field_validator("console_metrics")
    @classmethod
    def _non_empty_patterns(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not p.strip()]
        if bad:
            raise ValueError("console_metrics holds an empty pattern; remove it")
        return v


class WandbConfig(BaseModel):
    """The W&B run of a training run. One run per training run, files in ``run_dir/wandb``.

    ``mode=None`` (the default) resolves to ``online`` when an API key is configured
    (``WANDB_API_KEY`` or a ``api.wandb.ai`` entry in ``~/.netrc``) and ``offline``
    otherwise; offline runs are uploaded later with ``wandb sync run_dir/wandb/offline-run-*``.
    """

    model_config = ConfigDict(extra="forbid")

    mode: WandbMode | None = Field(None, description="online | offline | disabled | null=auto")
    project: str = "policy-probes"
    entity: str | None = None
    group: str | None = Field(None, description="Groups the seeds of one experiment.")
    tags: list[str] = Field(default_factory=list)
    name: str | None = Field(None, description="Display name; defaults to the run_dir name.")
    notes: str | None = None
    heatmap_every: int | None = Field(
        None,
        ge=1,
        description="Also log the units x epochs heatmaps and per-layer figures with the "
        "epoch record of every N-th epoch (they are always logged when the run closes; "
        "~0.1 s a figure).",
    )
    heatmap_history: int = Field(
        1000,
        ge=1,
        description="Epochs the session keeps of each series its figures draw (the heatmaps "
        "and per-layer figures show the last N).",
    )
    histogram_every: int = Field(
        10,
        ge=1,
        description="Log per-unit vectors as W&B histograms in epochs divisible by N and in "
        "the run's last epoch (scalars are logged every epoch; metrics.jsonl and the "
        "heatmaps keep every epoch's vectors). A histogram costs ~60 us to build and log, "
        "and a probed record holds dozens: 1 logs them every epoch.",
    )

    def resolved_mode(self) -> WandbMode:
        """The mode to use: the configured one, else online with an API key, else offline."""
        if self.mode is not None:
            return self.mode
        env_mode = os.environ.get("WANDB_MODE")
        if env_mode in ("online", "offline", "disabled"):
            return env_mode  # type: ignore[return-value]
        if env_mode == "dryrun":
            return "offline"
        return "online" if api_key_configured() else "offline"


def api_key_configured() -> bool:
    """True when W&B has an API key: ``WANDB_API_KEY`` or a netrc entry for its host.

    Only checks presence; the key itself is never read into our configuration.
    """
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = (
        os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        .split("://")[-1]
        .split("/")[0]
        .split(":")[0]
    )
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        auth = netrc.netrc(str(path)).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])
