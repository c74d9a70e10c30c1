"""What every result object shares: tidy frames at named levels, a repr that never raises, ``metadata``.

Every result (``PhaseEval``, ``Recording``, ``AblationResult``, ``PatchResult``, ``PhaseMap``,
``AttributionMap``, ``GateCyclingResult``, ``RepairTable``) offers:

* ``per_residue()`` and ``per_phase()``: tidy frames whose columns use the same names for the same
  quantities (:data:`COLUMNS`);
* ``to_frame(level=...)``: one tidy level (``"residue"`` by default; ``"phase"``; ``"item"`` where per-item
  rows exist);
* ``metadata``: the model's name and ``analysis_metadata`` and the exact arguments of the call;
* ``summary()`` and a ``repr`` that never raises; ``plot()``.
"""

from __future__ import annotations

import pandas as pd

from phaselens.core.errors import InputError

# The shared column vocabulary (docs/api.md): one name per quantity, in every result.
COLUMNS = {
    "residue": "(t_K - origin) mod M",
    "phase": "residue mod S",
    "n": "items in the group",
    "acc": "accuracy (fraction correct)",
    "clean_acc": "accuracy without the intervention",
    "ko_acc": "accuracy with the knockout",
    "rel_change": "100 (KO - clean) / clean, percent (NaN where undefined: clean < 2%)",
    "ci_low": "lower end of the 95% interval of the row's main quantity",
    "ci_high": "upper end of the 95% interval of the row's main quantity",
    "pvalue": "two-sided p-value of the row's test",
    "boundary": "the phase is S - 1",
}


class Result:
    """Mixin for the frozen result dataclasses; a subclass defines ``per_residue``, ``per_phase`` and
    ``summary`` (and ``per_item`` where item rows exist)."""

    LEVELS: tuple[str, ...] = ("residue", "phase")

    def per_residue(self) -> pd.DataFrame:
        raise NotImplementedError

    def per_phase(self) -> pd.DataFrame:
        raise NotImplementedError

    def to_frame(self, level: str = "residue") -> pd.DataFrame:
        """One tidy level: ``"residue"`` (default), ``"phase"`` or, where available, ``"item"``."""
        if level not in self.LEVELS:
            raise InputError(f"{type(self).__name__}.to_frame: level must be one of {self.LEVELS}, got {level!r}.")
        return {"residue": self.per_residue, "phase": self.per_phase}.get(level, getattr(self, "per_" + level))()

    def summary(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        try:
            return self.summary()
        except Exception as exc:  # a repr must never raise (a notebook would show a traceback instead)
            return f"<{type(self).__name__}: summary unavailable ({type(exc).__name__}: {exc})>"


def with_phase(frame: pd.DataFrame, stride: int) -> pd.DataFrame:
    """Add ``phase`` (and ``boundary``) after ``residue``."""
    out = frame.copy()
    out.insert(out.columns.get_loc("residue") + 1, "phase", out["residue"] % stride)
    return out
