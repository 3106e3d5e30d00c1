"""Configuration of the metric sinks (``sinks.*``) and of the W&B run (``wandb.*``); both
reject unknown keys (``wandb.projct=x`` fails naming the valid ones)."""

from __future__ import annotations

import netrc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policy_probes import plugins
from policy_probes.user_errors import mark_usage_error

if TYPE_CHECKING:
    from rich.console import Console

#: default seconds between the fsyncs of an append-only file at epoch ends
FSYNC_SECONDS = 30.0
#: the training loop's keys the console follows by default, before every registered
#: probe's console metrics (missing ones are simply not shown)
RUN_CONSOLE_METRICS: tuple[str, ...] = (
    "rollout/episode_return",
    "eval/return_mean",
    "train/policy_loss",
    "train/value_loss",
    "train/entropy",
    "train/approx_kl",
    "train/clipfrac",
    "perf/sps",
)


def default_console_metrics() -> list[str]:
    """:data:`RUN_CONSOLE_METRICS` and every registered probe's console metrics."""
    return [*RUN_CONSOLE_METRICS, *plugins.console_metrics()]


WandbMode = Literal["online", "offline", "disabled"]


class SinksConfig(BaseModel):
    """Which outputs a run writes (into ``run_dir``); a registered sink of your own is
    switched on like a built-in one: ``sinks.<its name>=true``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    console: bool = Field(True, description="Rich table at each SNAPSHOT and a live trend view.")
    console_metrics: list[str] | None = Field(
        None,
        description="Keys or glob patterns ('probes/relu/*/dead_fraction') the console shows; "
        "null: the training keys and every registered probe's console metrics.",
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
    def _non_empty_patterns(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not all(p.strip() for p in v):
            raise ValueError("console_metrics holds an empty pattern; remove it")
        return v

    @model_validator(mode="after")
    def _registered_sinks_only(self) -> SinksConfig:
        for key, value in (self.model_extra or {}).items():
            if key not in self.extra_keys():
                known = [*type(self).model_fields, *self.extra_keys()]
                raise ValueError(
                    f"unknown sinks key {key!r}: the keys are {', '.join(known)} (a sink of "
                    f"your own is selectable once the module that registers it is imported)"
                )
            if not isinstance(value, bool):
                raise ValueError(
                    f"sinks.{key} switches a sink on or off: true or false, not {value!r}"
                )
        return self

    @classmethod
    def extra_keys(cls) -> list[str]:
        """The registered sinks without a field of their own (sinks of your own)."""
        return [name for name in plugins.registered("sink") if name not in cls.model_fields]

    def enabled(self, name: str) -> bool:
        """Whether the sink registered as ``name`` is switched on."""
        if name in type(self).model_fields:
            return bool(getattr(self, name))
        return bool((self.model_extra or {}).get(name, False))


class WandbConfig(BaseModel):
    """The W&B run of a training run (files in ``run_dir/wandb``). ``mode=None`` resolves
    to ``WANDB_MODE``, else ``online`` with an API key (:func:`api_key_configured`), else
    ``offline`` (uploaded later with ``wandb sync run_dir/wandb/offline-run-*``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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

    def check_credentials(self) -> None:
        """Refuse a run asked to go online (``wandb.mode=online``, or ``WANDB_MODE=online``
        with ``mode`` unset) when W&B has no credentials (:func:`wandb_credentials`), before
        it trains: W&B would fail at ``wandb.init`` and the run would go on without its W&B
        run. A usage error saying what to do."""
        env_mode = os.environ.get("WANDB_MODE")
        asked = self.mode == "online" or (self.mode is None and env_mode == "online")
        if not asked or wandb_credentials():
            return
        given = "wandb.mode=online" if self.mode else "WANDB_MODE=online"
        raise mark_usage_error(
            ValueError(
                f"{given} needs W&B credentials and none were found (WANDB_API_KEY, the "
                f"netrc entry `wandb login` writes, W&B's settings files); set WANDB_API_KEY, "
                f"run `wandb login`, or use wandb.mode=offline (then `wandb sync` uploads "
                f"the run)"
            )
        )


def wandb_credentials() -> bool:
    """Whether W&B finds credentials for an online run, asked as W&B recommends
    (``wandb.login(prompt=False, verify=False)``: its environment variables, settings files
    and netrc; no prompt, no request to the server). Under ``WANDB_MODE=offline`` W&B
    answers no question, so :func:`api_key_configured` does."""
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun", "disabled"):
        return api_key_configured()
    import wandb  # slow to import: only for a run that goes online

    try:
        return bool(wandb.login(prompt=False, verify=False))
    except wandb.errors.AuthenticationError as exc:  # e.g. a malformed WANDB_API_KEY
        raise mark_usage_error(ValueError(f"W&B credentials: {exc}")) from None


def api_key_configured() -> bool:
    """Whether W&B has an API key (``WANDB_API_KEY`` or a netrc entry; never read)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    host = url.split("://")[-1].split("/")[0].split(":")[0]
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        auth = netrc.netrc(str(path)).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


@dataclass(frozen=True)
class SinkSetup:
    """What a sink is made from (:meth:`~policy_probes.sinks.base.MetricSink.from_setup`)."""

    run_dir: Path
    sinks: SinksConfig
    wandb: WandbConfig
    #: the run's resolved configuration
    config: dict[str, Any]
    #: the console shared with a progress bar, if any
    console: Console | None = None
