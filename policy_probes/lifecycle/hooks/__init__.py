"""The built-in lifecycle hooks, :data:`BUILTIN_HOOKS`: the registry registers them at its
first lookup (:meth:`~policy_probes.lifecycle.registry.HookRegistry.get`); within one
firing they run by ``order``, ties in the order of that tuple."""

from policy_probes.lifecycle.hooks.adam_dynamics import AdamDynamicsHook
from policy_probes.lifecycle.hooks.counterfactual import CounterfactualHook
from policy_probes.lifecycle.hooks.debug_corrupt import DebugCorruptHook
from policy_probes.lifecycle.hooks.feature_rank import FeatureRankHook
from policy_probes.lifecycle.hooks.hessian import HessianHook
from policy_probes.lifecycle.hooks.norms import NormsHook
from policy_probes.lifecycle.hooks.policy_fisher import PolicyFisherHook
from policy_probes.lifecycle.hooks.training_metrics import TrainingMetricsHook

#: every built-in hook class, in the order the registry registers them
BUILTIN_HOOKS = (
    AdamDynamicsHook,
    CounterfactualHook,
    DebugCorruptHook,
    FeatureRankHook,
    HessianHook,
    NormsHook,
    PolicyFisherHook,
    TrainingMetricsHook,
)

__all__ = [
    "BUILTIN_HOOKS",
    "AdamDynamicsHook",
    "CounterfactualHook",
    "DebugCorruptHook",
    "FeatureRankHook",
    "HessianHook",
    "NormsHook",
    "PolicyFisherHook",
    "TrainingMetricsHook",
]
