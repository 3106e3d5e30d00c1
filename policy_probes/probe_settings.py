"""ProbeSettings: how a run probes, one model for every loop: ``TrainTool`` (whose fields
they are), ``ProbeCallback(probing=...)`` and ``ProbeSession(probing=...)``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

import policy_probes.probes  # noqa: F401 - registers the built-in probes
import policy_probes.remedies  # noqa: F401 - registers the built-in remedies
from policy_probes.lifecycle import HookSelectionError, TrainingHook, select_hooks
from policy_probes.plugins import from_spec, split_specs
from policy_probes.sampling import DEFAULT_BUDGET, as_schedule, check_budget
from policy_probes.sinks import SinksConfig, WandbConfig


class ProbeSettings(BaseModel):
    """The probe settings of a run: faults, lifecycle hooks, sampling, snapshots, sinks."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    strict: bool = Field(
        False, description="Probe faults stop training instead of disabling the probe."
    )
    hooks: list[str] = Field(
        default_factory=list,
        description="Lifecycle hooks (names or groups) to enable; `policy-probes hooks list`.",
    )
    with_hooks: str | None = Field(
        None,
        description="A hook group: none, minimal, observers, interventions, full, all, with_debug.",
    )
    hook_config: dict[str, Any] | list[str] = Field(
        default_factory=dict,
        description='Hook parameters, "name.param" -> value (e.g. {"hessian.iters": 30}).',
    )
    probe_budget: float | None = Field(
        DEFAULT_BUDGET,
        description="The probes observe passes 0, 16, 32, ... of every epoch and report "
        "every epoch; this fraction of wall time is checked once, after the third epoch, "
        "and may raise an expensive probe's stride (never below one pass per epoch). "
        "None: every pass.",
    )
    probe_schedule: str | None = Field(
        None,
        description="Schedule of probes built without schedule=: every (exact, every pass), "
        "every_k:<k>, per_epoch:<n>, probe_batch:<rows> (a dedicated pass at the epoch end), "
        "budget (the default with a budget).",
    )
    snapshot_every: int = Field(
        0,
        ge=0,
        description="Fire SNAPSHOT (expensive hooks such as hessian; the console's snapshot "
        "table) every N epochs; 0 = never.",
    )
    probes: list[str] = Field(
        default_factory=list,
        description='Probes to attach besides those the code attaches, "name@component'
        '[:key=value,...]" each (settings and placement), e.g. '
        '"relu@actor_mlp:tau=0.05,per_layer=false"; `policy-probes plugins` lists the '
        'names. A JSON list or one string of specs separated by ";".',
    )
    remedies: list[str] = Field(
        default_factory=list,
        description='Remedies to switch on, "name@component[:key=value,...]" each, e.g. '
        '"redo@critic_mlp:tau=0.025,every_epochs=25" (docs/remedies.md); a JSON list or '
        'one string of specs separated by ";".',
    )
    sinks: SinksConfig = Field(default_factory=SinksConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("probe_budget")
    @classmethod
    def _check_probe_budget(cls, v: float | None) -> float | None:
        return check_budget(v)

    @field_validator("probe_schedule", mode="before")
    @classmethod
    def _check_probe_schedule(cls, v: Any) -> str | None:
        return None if v is None else str(as_schedule(v))

    @field_validator("probes", "remedies", mode="before")
    @classmethod
    def _check_specs(cls, v: Any, info: ValidationInfo) -> list[str]:
        kind = "probe" if info.field_name == "probes" else "remedy"
        specs = split_specs(v, kind)
        for spec in specs:
            from_spec(spec, kind)  # unknown plugin or key, bad value: a clear error now
        return specs

    @field_validator("hooks", mode="before")
    @classmethod
    def _split_hook_names(cls, v: Any) -> Any:
        # `hooks=norms,hessian` on the command line arrives as one string
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check_hooks(self) -> Any:
        self.lifecycle_hooks()  # unknown hooks, groups, parameters or values: clear error
        return self

    def lifecycle_hooks(self) -> list[TrainingHook]:
        """Fresh instances of the selected lifecycle hooks (``hooks``, ``with_hooks``,
        ``hook_config``); raises ``ValueError`` naming the valid choices."""
        try:
            return select_hooks(self.hooks, self.with_hooks, self.hook_config)
        except HookSelectionError as exc:
            raise ValueError(str(exc)) from None
