"""Interventions: knockouts, ablation, activation patching and gate cycling."""

from phaselens.interventions.ablate import AblationResult, ablate
from phaselens.interventions.cycling import GateCyclingResult, cycle_gates, gate_cycling_test
from phaselens.interventions.knockout import Calibration, Knockout, calibrate, knockout
from phaselens.interventions.patch import PatchResult, patch

__all__ = [
    "AblationResult",
    "Calibration",
    "GateCyclingResult",
    "Knockout",
    "PatchResult",
    "ablate",
    "calibrate",
    "cycle_gates",
    "gate_cycling_test",
    "knockout",
    "patch",
]
