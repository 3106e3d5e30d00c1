"""policy-probes: forward and backward probes on the named parts of an RL policy.

The public names are imported on first use (PEP 562), so that ``import policy_probes``
and the ``policy-probes`` command line's ``--help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policy_probes.components import PolicyAutoBuilder, ProbeHandle
    from policy_probes.context import ComponentContext
    from policy_probes.layers import MLP, ConvLayer, HiddenLayer, LinearSpec, MLPSpec
    from policy_probes.plugins import Rule, register
    from policy_probes.probe_settings import ProbeSettings
    from policy_probes.probes import (
        Churn,
        FisherInformation,
        GradientFlow,
        Preactivation,
        ReLUActivation,
        ReLUGradientFlow,
        SaturatedActivation,
        SaturatedSigmoid,
        SaturatedTanh,
        Trainability,
        Utility,
        Weights,
        attach_churn_hooks,
        attach_fisher_information_hooks,
        attach_gradient_flow_hooks,
        attach_preactivation_hooks,
        attach_relu_activation_hooks,
        attach_relu_gradient_flow_hooks,
        attach_saturated_activation_hooks,
        attach_trainability_hooks,
        attach_utility_hooks,
        attach_weights_hooks,
    )
    from policy_probes.probes.observation import Observation
    from policy_probes.probes.probe import Placement, Probe, ProbeBuilder
    from policy_probes.run import Run
    from policy_probes.session import ProbeSession
    from policy_probes.stats_reporter import StatsReporter
    from policy_probes.user_errors import ProbeError

__version__ = "0.1.0"

__all__ = [
    "MLP",
    "ComponentContext",
    "ConvLayer",
    "HiddenLayer",
    "LinearSpec",
    "MLPSpec",
    "Observation",
    "Placement",
    "PolicyAutoBuilder",
    "Probe",
    "ProbeBuilder",
    "ProbeError",
    "ProbeHandle",
    "ProbeSession",
    "ProbeSettings",
    "Rule",
    "Run",
    "StatsReporter",
    "register",
    # the built-in probes and their attach_*_hooks() (policy_probes.probes.__all__)
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

#: the module of each public name but the built-in probes (policy_probes.probes)
_HOMES: dict[str, str] = {
    "MLP": "policy_probes.layers",
    "ComponentContext": "policy_probes.context",
    "ConvLayer": "policy_probes.layers",
    "HiddenLayer": "policy_probes.layers",
    "LinearSpec": "policy_probes.layers",
    "MLPSpec": "policy_probes.layers",
    "Observation": "policy_probes.probes.observation",
    "Placement": "policy_probes.probes.probe",
    "PolicyAutoBuilder": "policy_probes.components",
    "Probe": "policy_probes.probes.probe",
    "ProbeBuilder": "policy_probes.probes.probe",
    "ProbeError": "policy_probes.user_errors",
    "ProbeHandle": "policy_probes.components",
    "ProbeSession": "policy_probes.session",
    "ProbeSettings": "policy_probes.probe_settings",
    "Rule": "policy_probes.plugins",
    "Run": "policy_probes.run",
    "StatsReporter": "policy_probes.stats_reporter",
    "register": "policy_probes.plugins",
}


def __getattr__(name: str) -> Any:
    """Import the module of the public ``name`` on first use (and the ``probes`` package)."""
    if name == "probes":
        return importlib.import_module("policy_probes.probes")
    if name not in __all__:
        raise AttributeError(f"module 'policy_probes' has no attribute {name!r}")
    home = _HOMES.get(name, "policy_probes.probes")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the public ones not yet imported too."""
    return sorted({*globals(), *__all__, "probes"})
