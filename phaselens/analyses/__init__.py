"""Analyses: one module per analysis, each run by the shared pipeline (``runner``) on any
:class:`~phaselens.contract.protocol.PhaseModel`. Analyses never import a model class.

``phaselens.analyses.knocked_out(model, heads, ...)`` is the knockout over arbitrary inputs (a ``with`` block, or
hooks for one call: :class:`~phaselens.analyses.knockouts.Knockout`); the analysis ``phaselens.knockout`` evaluates
a task with the heads knocked out. Names resolve on first use, so importing this package loads no torch.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

_EXPORTS = {"knocked_out": "phaselens.analyses.knockouts", "Knockout": "phaselens.analyses.knockouts"}

if TYPE_CHECKING:
    from phaselens.analyses.knockouts import Knockout, knocked_out  # noqa: F401


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'phaselens.analyses' has no attribute {name!r}")


__all__ = ["Knockout", "knocked_out"]
