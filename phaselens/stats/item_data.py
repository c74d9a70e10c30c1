"""Per-item data: validating the frame and recognising a paired design.

A design is *paired* when every item appears at every residue exactly once; then the outcomes form a
complete ``(items, M)`` matrix, and tests that compare an item with itself (Cochran's Q, Friedman, within-item
permutation) apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_values, item_codes, readonly, resolve_residues
from phaselens.stats.subset import ResidueSubset, residue_subset

REQUIRED_COLUMNS = ("item_id", "residue", "correct")
DEFAULT_METRICS = ("nll", "logit_diff")


def pairing(item: np.ndarray, residues: np.ndarray, modulus: int, names: np.ndarray | None = None) -> str | None:
    """``None`` when every item appears exactly once at every residue; otherwise the reason it does not.

    ``residues`` may be columns 0..K−1 of a residue subset, with ``names`` ``(K,)`` the residues they stand for.
    """
    n_items = int(item.max()) + 1
    cells = np.zeros((n_items, modulus), dtype=np.int64)
    np.add.at(cells, (item, residues), 1)
    if np.any(cells > 1):
        i, r = np.argwhere(cells > 1)[0]
        return (
            f"not paired: an item appears {cells[i, r]} times at residue {r if names is None else names[r]}; "
            "each item needs one row per residue"
        )
    if np.any(cells == 0):
        missing = int((cells == 0).any(axis=1).sum())
        return f"not paired: {missing} of {n_items} items lack some of the {modulus} residues"
    return None


def paired_matrix(item: np.ndarray, residues: np.ndarray, values: np.ndarray, modulus: int) -> np.ndarray:
    """``(items, M)`` matrix of a paired design (call only when :func:`pairing` returned ``None``)."""
    out = np.empty((int(item.max()) + 1, modulus))
    out[item, residues] = values
    return out


@dataclass(frozen=True, repr=False, eq=False)
class ItemTable:
    """Validated per-item rows.

    Attributes:
        item: ``(N,)`` dense item codes.
        residue: ``(N,)`` residues in 0..M−1.
        correct: ``(N,)`` 0/1 floats.
        metrics: continuous metrics present, name → ``(N,)`` floats.
        stride, modulus: S and M.
        pairing_note: ``None`` for a paired design, else why it is not paired.
        subset: the residues the design covers (all of 0..M−1 unless ``residues=`` was passed).
    """

    item: np.ndarray
    residue: np.ndarray
    correct: np.ndarray
    metrics: dict[str, np.ndarray]
    stride: int
    modulus: int
    pairing_note: str | None
    subset: ResidueSubset

    def __post_init__(self) -> None:
        readonly(self.item, self.residue, self.correct, *self.metrics.values())

    @property
    def paired(self) -> bool:
        return self.pairing_note is None

    @property
    def n_items(self) -> int:
        return int(self.item.max()) + 1

    @property
    def column(self) -> np.ndarray:
        """``(N,)`` each row's column among the residues covered (its residue when all are)."""
        return self.subset.column(self.residue)

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(correct, n)`` at each residue covered (``subset.residues``), each ``(K,)`` int64."""
        k = self.subset.residues.size
        n = np.bincount(self.column, minlength=k)
        c = np.bincount(self.column, weights=self.correct, minlength=k)
        return np.rint(c).astype(np.int64), n.astype(np.int64)

    def matrix(self, values: np.ndarray) -> np.ndarray:
        """``(items, K)`` matrix of ``values`` for a paired design, one column per residue covered."""
        if not self.paired:
            raise StatsInputError(f"design is {self.pairing_note}")
        return paired_matrix(self.item, self.column, values, self.subset.residues.size)


def item_table(
    frame: pd.DataFrame, stride: int, modulus: int | None = None, metrics: Sequence[str] = DEFAULT_METRICS,
    residues: ArrayLike | None = None,
) -> ItemTable:
    """Validate a per-item frame with columns ``item_id``, ``residue``, ``correct`` (+ optional metrics).

    ``modulus`` defaults to ``max(residue) + 1`` rounded up to a multiple of ``stride``. Every residue
    0..M−1 needs rows, or, with ``residues``, exactly the residues listed do (a design over a subset).
    """
    if not isinstance(frame, pd.DataFrame):
        raise StatsInputError(f"expected a pandas DataFrame, got {type(frame).__name__}.")
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise StatsInputError(
            f"frame lacks columns {missing}; it needs {list(REQUIRED_COLUMNS)} (rename yours to match)."
        )
    if len(frame) == 0:
        raise StatsInputError("frame is empty; pass one row per (item, residue) outcome.")
    residue, stride, modulus = resolve_residues(frame["residue"].to_numpy(), stride, modulus)
    correct = check_values(frame["correct"].to_numpy(), "column 'correct'", residue.size)
    if not np.all((correct == 0) | (correct == 1)):
        raise StatsInputError(
            "column 'correct' must be 0/1 or bool; threshold scores into right/wrong first."
        )
    found = {
        m: check_values(frame[m].to_numpy(), f"column {m!r}", residue.size) for m in metrics if m in frame
    }
    sub = residue_subset(residues, stride, modulus)
    has = np.zeros(modulus, bool)
    has[residue] = True
    listed = np.zeros(modulus, bool)
    listed[sub.residues] = True
    if np.any(has & ~listed):
        extra = np.flatnonzero(has & ~listed).tolist()
        raise StatsInputError(f"rows at residues {extra}, which residues={sub.residues.tolist()} leaves out; "
                              "list every residue the rows cover.")
    if np.any(listed & ~has):
        missing = np.flatnonzero(listed & ~has).tolist()
        hint = (f"pass residues={np.flatnonzero(has).tolist()} to test the residues present, or a smaller modulus"
                if residues is None else "drop them from residues")
        raise StatsInputError(f"residues {missing} have no rows; every residue "
                              f"{'0..' + str(modulus - 1) if residues is None else 'listed'} needs items ({hint}).")
    item = item_codes(frame["item_id"].to_numpy(), residue.size)
    note = pairing(item, sub.column(residue), sub.residues.size, sub.residues)
    return ItemTable(item, residue, correct, found, stride, modulus, note, sub)
