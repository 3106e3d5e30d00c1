"""Lifecycle hooks: code run at well-defined points of a training loop. Observers read the
run; interventions change training state only inside a guardian checkpoint that is always
restored, so they never alter the trajectory (``docs/lifecycle.md``).

The names are imported on first use (PEP 562): the hooks import torch, the command line's
``--hook*`` options need only the registry; the built-in hooks register on the registry's
first lookup (:meth:`HookRegistry.classes`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: the module of each name of :data:`__all__`
_HOMES: dict[str, str] = {
    "COST_CLASSES": "policy_probes.lifecycle.hook",
    "GROUPS": "policy_probes.lifecycle.registry",
    "KEYWORDS": "policy_probes.lifecycle.registry",
    "LOOP_TYPES": "policy_probes.lifecycle.points",
    "STEP_POINTS": "policy_probes.lifecycle.points",
    "DebugInterventionHook": "policy_probes.lifecycle.hook",
    "EpochWindow": "policy_probes.lifecycle.points",
    "HookConfig": "policy_probes.lifecycle.hook",
    "HookManager": "policy_probes.lifecycle.manager",
    "HookPoint": "policy_probes.lifecycle.points",
    "HookRegistry": "policy_probes.lifecycle.registry",
    "HookSelectionError": "policy_probes.lifecycle.registry",
    "InterventionHook": "policy_probes.lifecycle.hook",
    "LoopModelDataContext": "policy_probes.lifecycle.model_context",
    "ModelDataContext": "policy_probes.lifecycle.model_context",
    "RunDataContext": "policy_probes.lifecycle.run_context",
    "StepFlush": "policy_probes.lifecycle.manager",
    "StepRecord": "policy_probes.lifecycle.manager",
    "StepSchedule": "policy_probes.lifecycle.schedule",
    "TrainingHook": "policy_probes.lifecycle.hook",
    "capture_rng_state": "policy_probes.lifecycle.rng",
    "parse_hook_config": "policy_probes.lifecycle.registry",
    "preserved_rng": "policy_probes.lifecycle.rng",
    "resolve_hook_names": "policy_probes.lifecycle.registry",
    "restore_rng_state": "policy_probes.lifecycle.rng",
    "select_hooks": "policy_probes.lifecycle.registry",
    "snapshot_due": "policy_probes.lifecycle.points",
}


def __getattr__(name: str) -> Any:
    """Import the module of ``name`` on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'policy_probes.lifecycle' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, those not imported yet too."""
    return sorted({*globals(), *__all__})
