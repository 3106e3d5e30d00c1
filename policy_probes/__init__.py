"""policy-probes: forward and backward probes on the named parts of an RL policy."""

from policy_probes.components import PolicyAutoBuilder, ProbeHandle
from policy_probes.context import ComponentContext
from policy_probes.hook_types import BackwardHookBuilder, HookBuilder, ProbeError, ProbeHook
from policy_probes.layers import MLP, ConvLayer, HiddenLayer, LinearSpec, MLPSpec
from policy_probes.probe_settings import ProbeSettings
from policy_probes.probes import (
    ChurnState,
    FisherInformationState,
    GradientFlowState,
    PreactivationState,
    ProbeState,
    ReLUActivationState,
    ReLUGradientFlowState,
    SaturatedActivationState,
    UtilityState,
    WeightsState,
    attach_churn_hooks,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_preactivation_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
    attach_utility_hooks,
    attach_weights_hooks,
)
from policy_probes.run import Run
from policy_probes.session import Loop, ProbeSession
from policy_probes.stats_reporter import StatsReporter

__version__ = "0.1.0"

__all__ = [
    "MLP",
    "BackwardHookBuilder",
    "ChurnState",
    "ComponentContext",
    "ConvLayer",
    "FisherInformationState",
    "GradientFlowState",
    "HiddenLayer",
    "HookBuilder",
    "LinearSpec",
    "Loop",
    "MLPSpec",
    "PolicyAutoBuilder",
    "ProbeError",
    "ProbeHandle",
    "ProbeHook",
    "ProbeSession",
    "ProbeSettings",
    "PreactivationState",
    "ProbeState",
    "ReLUActivationState",
    "ReLUGradientFlowState",
    "Run",
    "SaturatedActivationState",
    "StatsReporter",
    "UtilityState",
    "WeightsState",
    "attach_churn_hooks",
    "attach_fisher_information_hooks",
    "attach_gradient_flow_hooks",
    "attach_preactivation_hooks",
    "attach_relu_activation_hooks",
    "attach_relu_gradient_flow_hooks",
    "attach_saturated_activation_hooks",
    "attach_utility_hooks",
    "attach_weights_hooks",
]
