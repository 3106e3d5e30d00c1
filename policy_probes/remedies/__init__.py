"""Remedies for lost plasticity, fired from the probes' own measurements; unlike lifecycle
interventions they change the trajectory on purpose. Attach one with ``add_remedy`` or a
``remedies=`` spec (``"redo@critic_mlp:tau=0.025,every_epochs=25"``; ``docs/remedies.md``)."""

from policy_probes.remedies.base import (
    BoundRemedy,
    Remedy,
    RemedyRunner,
    RemedyTarget,
    check_remedy,
)
from policy_probes.remedies.continual_backprop import ContinualBackprop, continual_backprop
from policy_probes.remedies.dormant_recycling import ReDo, redo
from policy_probes.remedies.l2_init import L2Init, l2_init
from policy_probes.remedies.layer_reset import ResetLayers, reset_layers
from policy_probes.remedies.optim_state import SUPPORTED_OPTIMIZERS
from policy_probes.remedies.plasticity_injection import PlasticityInjection, plasticity_injection
from policy_probes.remedies.shrink_perturb import ShrinkAndPerturb, shrink_and_perturb
from policy_probes.remedies.soft_shrink_perturb import SoftShrinkPerturb, soft_shrink_perturb
from policy_probes.remedies.step_remedy import StepRemedy
from policy_probes.remedies.trigger import Threshold, Trigger

__all__ = [
    "ContinualBackprop",
    "L2Init",
    "PlasticityInjection",
    "SoftShrinkPerturb",
    "StepRemedy",
    "continual_backprop",
    "l2_init",
    "plasticity_injection",
    "soft_shrink_perturb",
    "SUPPORTED_OPTIMIZERS",
    "BoundRemedy",
    "ReDo",
    "Remedy",
    "RemedyRunner",
    "RemedyTarget",
    "ResetLayers",
    "ShrinkAndPerturb",
    "Threshold",
    "Trigger",
    "check_remedy",
    "redo",
    "reset_layers",
    "shrink_and_perturb",
]
