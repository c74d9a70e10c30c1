"""Folding residues onto phases, and the max−min gap.

A residue r (mod M) has phase r mod S. Folding sums the counts of the M/S residues that share a phase, so the
folded table keeps every trial exactly once.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from phaselens.stats._checks import check_counts, check_period, check_stride


def fold(x: np.ndarray, period: int) -> np.ndarray:
    """Sum ``(..., M)`` along the last axis into ``(..., period)``: entry p sums residues r ≡ p (mod period).

    No validation: ``period`` must divide ``M``. Used on counts, never on accuracies.
    """
    m = x.shape[-1]
    return x.reshape(*x.shape[:-1], m // period, period).sum(axis=-2)


def fold_by(x: np.ndarray, codes: np.ndarray, k: int) -> np.ndarray:
    """Sum ``(..., K)`` along the last axis into ``(..., k)``: entry j sums the columns whose code is j.

    The general form of :func:`fold` for columns that are any subset of residues (``codes`` ``(K,)`` in
    0..k−1, e.g. each present residue's phase). Integer inputs stay exact (integer matmul).
    """
    dtype = np.int64 if x.dtype.kind in "biu" else np.float64
    onehot = (np.asarray(codes)[:, None] == np.arange(k)[None, :]).astype(dtype)
    return np.asarray(x, dtype=dtype) @ onehot


def fold_counts(correct: ArrayLike | int | float, n: ArrayLike | int | float, period: int) -> tuple[np.ndarray, np.ndarray]:
    """Fold per-residue counts mod ``period``.

    Args:
        correct: ``(..., M)`` correct answers per residue.
        n: an int or ``(..., M)`` trials per residue.
        period: a divisor of M (usually the stride S).

    Returns:
        ``(correct, n)`` folded, each ``(..., period)``; their totals equal the inputs' totals.

    Example:
        >>> c, n = fold_counts([112, 178, 169, 76, 115, 179, 165, 84], 256, 4)
        >>> c.tolist(), n.tolist()
        ([227, 357, 334, 160], [512, 512, 512, 512])
    """
    c, t = check_counts(correct, n)
    period = check_period(period, c.shape[-1])
    return fold(c, period), fold(t, period)


def gap(accuracy: np.ndarray) -> np.ndarray:
    """Max − min over the last axis of ``(..., K)`` → ``(...)``."""
    return np.ptp(accuracy, axis=-1)


def folded_gap_from_counts(correct: np.ndarray, n: np.ndarray, period: int) -> np.ndarray:
    """Folded max−min accuracy gap of validated counts ``(..., M)`` → ``(...)`` (no validation)."""
    return gap(fold(correct, period) / fold(n, period))


def residue_gap(correct: ArrayLike | int | float, n: ArrayLike | int | float) -> float:
    """Max − min of per-residue accuracy ``correct / n``, not folded: the paper's "gap across residues".

    Example:
        >>> round(100 * residue_gap([112, 178, 169, 76, 115, 179, 165, 84], 256), 2)
        40.23
    """
    c, t = check_counts(correct, n)
    return float(gap(c / t))


def folded_gap(correct: ArrayLike | int | float, n: ArrayLike | int | float, stride: int) -> float:
    """Max − min of per-phase accuracy after folding residues mod ``stride`` (counts summed, not averaged).

    Example:
        >>> round(100 * folded_gap([112, 178, 169, 76, 115, 179, 165, 84], 256, 4), 2)
        38.48
    """
    c, t = check_counts(correct, n)
    stride, _ = check_stride(stride, c.shape[-1])
    return float(folded_gap_from_counts(c, t, stride))
