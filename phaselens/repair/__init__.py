"""Phase repair: test-time phase ensembling (``phase_ensemble``) and its measurement (``repair_table``)."""

from phaselens.repair.ensemble import (
    COMBINES,
    PhaseEnsemble,
    combine,
    phase_ensemble,
    resolve_shifts,
    shifted_copies,
)
from phaselens.repair.table import RepairTable, copy_query_logits, repair_table

__all__ = [
    "COMBINES",
    "PhaseEnsemble",
    "RepairTable",
    "combine",
    "copy_query_logits",
    "phase_ensemble",
    "repair_table",
    "resolve_shifts",
    "shifted_copies",
]
