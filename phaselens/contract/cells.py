"""Cells: the interventions a query-suffix engine runs (analyses build them, each model kind's engine runs them;
``phaselens.models.parts.suffix_engine``), and the engine's default memory budget of one pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

PASS_BYTES = 2**30  # default memory budget of one cell pass (its repeated cache and attention temporaries)


@dataclass
class Cell:
    """One intervention: at ``layer``, replace ``z`` of the ``heads`` at the query position.

    ``replacement`` is ``[N, len(heads), d]`` (per item) or ``[len(heads), d]`` (shared); ``None`` means zero.
    """

    layer: int
    heads: Sequence[int]
    replacement: Tensor | None = None
