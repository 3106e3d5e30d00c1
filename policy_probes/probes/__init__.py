"""The built-in probes: one module per probe, its tracker beside its builder."""

from policy_probes.probes.churn import ChurnState, attach_churn_hooks
from policy_probes.probes.fisher import FisherInformationState, attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import GradientFlowState, attach_gradient_flow_hooks
from policy_probes.probes.preactivation import (
    PreactivationState,
    attach_preactivation_hooks,
)
from policy_probes.probes.relu import ReLUActivationState, attach_relu_activation_hooks
from policy_probes.probes.relu_gradient_flow import (
    ReLUGradientFlowState,
    attach_relu_gradient_flow_hooks,
)
from policy_probes.probes.saturation import (
    SaturatedActivationState,
    attach_saturated_activation_hooks,
)
from policy_probes.probes.state import ProbeState
from policy_probes.probes.utility import UtilityState, attach_utility_hooks
from policy_probes.probes.weights import WeightsState, attach_weights_hooks

__all__ = [
    "ChurnState",
    "FisherInformationState",
    "GradientFlowState",
    "PreactivationState",
    "ProbeState",
    "ReLUActivationState",
    "ReLUGradientFlowState",
    "SaturatedActivationState",
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
