"""Plotly figures of phaselens results. Each function takes a result object and returns a Figure.

Plotting never computes: every number drawn comes from the result object it is given.
"""

from phaselens.plots.knockouts import (
    attribution_heatmap,
    head_phase_heatmap,
    layer_knockout_map,
    patch_heatmap,
)
from phaselens.plots.mechanism import (
    gate_concentration,
    gate_cycling_scatter,
    gate_profiles,
    r2_note,
    read_side_attention,
)
from phaselens.plots.phase import accuracy_by_residue, periodicity_panel, phase_rose, repair_panel
from phaselens.plots.theme import TEMPLATE, head_label, phase_label
from phaselens.plots.training import loss_curve

__all__ = [
    "TEMPLATE",
    "attribution_heatmap",
    "accuracy_by_residue",
    "gate_concentration",
    "gate_cycling_scatter",
    "gate_profiles",
    "head_label",
    "head_phase_heatmap",
    "layer_knockout_map",
    "loss_curve",
    "patch_heatmap",
    "periodicity_panel",
    "phase_label",
    "phase_rose",
    "r2_note",
    "read_side_attention",
    "repair_panel",
]
