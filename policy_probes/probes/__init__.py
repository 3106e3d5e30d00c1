"""The built-in probes: one module per probe, its measurement class beside the
``attach_*_hooks()`` function that makes it (each registered with
:mod:`policy_probes.plugins` when its module is imported)."""

from policy_probes.probes.churn import Churn, attach_churn_hooks
from policy_probes.probes.fisher import FisherInformation, attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import GradientFlow, attach_gradient_flow_hooks
from policy_probes.probes.preactivation import Preactivation, attach_preactivation_hooks
from policy_probes.probes.relu import ReLUActivation, attach_relu_activation_hooks
from policy_probes.probes.relu_gradient_flow import (
    ReLUGradientFlow,
    attach_relu_gradient_flow_hooks,
)
from policy_probes.probes.saturation import (
    SaturatedActivation,
    SaturatedSigmoid,
    SaturatedTanh,
    attach_saturated_activation_hooks,
)
from policy_probes.probes.trainability import Trainability, attach_trainability_hooks
from policy_probes.probes.utility import Utility, attach_utility_hooks
from policy_probes.probes.weights import Weights, attach_weights_hooks

__all__ = [
    "Churn",
    "FisherInformation",
    "GradientFlow",
    "Preactivation",
    "ReLUActivation",
    "ReLUGradientFlow",
    "SaturatedActivation",
    "SaturatedSigmoid",
    "SaturatedTanh",
    "Trainability",
    "Utility",
    "Weights",
    "attach_churn_hooks",
    "attach_fisher_information_hooks",
    "attach_gradient_flow_hooks",
    "attach_preactivation_hooks",
    "attach_relu_activation_hooks",
    "attach_relu_gradient_flow_hooks",
    "attach_saturated_activation_hooks",
    "attach_trainability_hooks",
    "attach_utility_hooks",
    "attach_weights_hooks",
]
