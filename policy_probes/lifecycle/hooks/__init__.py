"""The built-in lifecycle hooks (importing this package registers them); within one firing
they run by ``order``, ties in the import order below."""

from policy_probes.lifecycle.hooks.adam_dynamics import AdamDynamicsHook
from policy_probes.lifecycle.hooks.counterfactual import CounterfactualHook
from policy_probes.lifecycle.hooks.debug_corrupt import DebugCorruptHook
from policy_probes.lifecycle.hooks.feature_rank import FeatureRankHook
from policy_probes.lifecycle.hooks.hessian import HessianHook
from policy_probes.lifecycle.hooks.norms import NormsHook
from policy_probes.lifecycle.hooks.policy_fisher import PolicyFisherHook
from policy_probes.lifecycle.hooks.training_metrics import TrainingMetricsHook

__all__ = [
    "AdamDynamicsHook",
    "CounterfactualHook",
    "DebugCorruptHook",
    "FeatureRankHook",
    "HessianHook",
    "NormsHook",
    "PolicyFisherHook",
    "TrainingMetricsHook",
]
