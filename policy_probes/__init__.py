"""policy-probes: forward and backward probes on the named parts of an RL policy."""

from policy_probes import probes
from policy_probes.components import PolicyAutoBuilder, ProbeHandle
from policy_probes.context import ComponentContext
from policy_probes.layers import MLP, ConvLayer, HiddenLayer, LinearSpec, MLPSpec
from policy_probes.plugins import Rule, register
from policy_probes.probe_settings import ProbeSettings
from policy_probes.probes import *  # noqa: F403 - the built-in probes, probes.__all__
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
    *probes.__all__,  # the built-in probes and their attach_*_hooks()
]
