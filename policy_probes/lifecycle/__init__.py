"""Lifecycle hooks: code run at well-defined points of a training loop. Observers read the
run; interventions change training state only inside a guardian checkpoint that is always
restored, so they never alter the trajectory (``docs/lifecycle.md``)."""

import policy_probes.lifecycle.hooks  # noqa: F401  (registers the built-in hooks)
from policy_probes.lifecycle.hook import (
    COST_CLASSES,
    DebugInterventionHook,
    HookConfig,
    InterventionHook,
    TrainingHook,
)
from policy_probes.lifecycle.manager import HookManager, StepFlush, StepRecord
from policy_probes.lifecycle.model_context import LoopModelDataContext, ModelDataContext
from policy_probes.lifecycle.points import (
    LOOP_TYPES,
    STEP_POINTS,
    EpochWindow,
    HookPoint,
    snapshot_due,
)
from policy_probes.lifecycle.registry import (
    GROUPS,
    KEYWORDS,
    HookRegistry,
    HookSelectionError,
    parse_hook_config,
    resolve_hook_names,
    select_hooks,
)
from policy_probes.lifecycle.rng import capture_rng_state, preserved_rng, restore_rng_state
from policy_probes.lifecycle.run_context import RunDataContext
from policy_probes.lifecycle.schedule import StepSchedule

__all__ = [
    "COST_CLASSES",
    "GROUPS",
    "KEYWORDS",
    "LOOP_TYPES",
    "STEP_POINTS",
    "DebugInterventionHook",
    "EpochWindow",
    "HookConfig",
    "HookManager",
    "HookPoint",
    "HookRegistry",
    "HookSelectionError",
    "InterventionHook",
    "LoopModelDataContext",
    "ModelDataContext",
    "RunDataContext",
    "StepFlush",
    "StepRecord",
    "StepSchedule",
    "TrainingHook",
    "capture_rng_state",
    "parse_hook_config",
    "preserved_rng",
    "resolve_hook_names",
    "restore_rng_state",
    "select_hooks",
    "snapshot_due",
]
