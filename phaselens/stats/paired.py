"""Tests that respect the pairing when every item is answered at every residue.

With item difficulty varying, outcomes of one item at different residues are positively correlated. Tests on
residue totals (χ², G, the nested fold test) treat the totals as independent binomials and so overstate their
variance: they lose size (0.5% instead of 5% in docs/statistics.md's simulation) and power. Conditioning on the
items fixes both:

* :func:`~phaselens.stats.omnibus.cochran_q` is the omnibus test across the M residues;
* :func:`nested_cochran_q`, the paired nested test of "accuracy depends on the residue only through
  residue mod P": Cochran's Q computed within each class of residues that share r mod P, summed over the P
  classes. Under the null the residues of a class are exchangeable within each item, the class statistics are
  conditionally independent given each item's class totals, and the sum is χ² with Σ(k_p − 1) df.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_period
from phaselens.stats.folding import fold_by
from phaselens.stats.outcomes import TestResult


def binary_matrix(matrix: ArrayLike | int | float, name: str = "matrix") -> np.ndarray:
    """Validate an ``(items, M)`` matrix of 0/1 outcomes and return it as int64."""
    x = np.asarray(matrix)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 2:
        raise StatsInputError(f"{name} must be 2-D [items, residues] with at least 2 residues, got {x.shape}.")
    if x.dtype.kind not in "biuf" or not np.all((x == 0) | (x == 1)):
        raise StatsInputError(f"{name} needs 0/1 (or bool) outcomes; threshold continuous scores first.")
    return x.astype(np.int64)


def stratified_q(x: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray]:
    """Cochran's Q within each residue class mod ``period`` for a batch of 0/1 matrices.

    Args:
        x: ``(..., items, M)`` 0/1 outcomes.
        period: P dividing M; class p holds residues p, p + P, ..., (k = M/P residues).

    Returns:
        ``(q, informative)``: ``(..., P)`` statistics and whether the class had any discordant item (a class
        with none has Q = 0 and no degrees of freedom).
    """
    q, informative, _ = stratified_q_by(x, np.arange(x.shape[-1]) % period, period)
    return q, informative


def stratified_q_by(x: np.ndarray, codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cochran's Q within each class of columns for classes of any sizes (columns of a residue subset).

    Args:
        x: ``(..., items, K)`` 0/1 outcomes.
        codes: ``(K,)`` class of each column, in 0..k−1.
        k: number of classes.

    Returns:
        ``(q, informative, size)``: ``(..., k)`` statistics, whether the class had a discordant item, and
        ``(k,)`` columns per class (a one-column class is never informative).
    """
    x = np.asarray(x, dtype=np.float64)
    size = np.bincount(codes, minlength=k).astype(np.float64)
    col = x.sum(axis=-2)  # (..., K) totals per column
    row = fold_by(x, codes, k)  # (..., items, k) each item's total within the class
    total = row.sum(axis=-2)  # (..., k)
    denom = size * total - (row**2).sum(axis=-2)
    informative = denom > 0
    num = (size - 1) * (size * fold_by(col**2, codes, k) - total**2)
    q = np.where(informative, num / np.where(informative, denom, 1.0), 0.0)
    return q, informative, size


def nested_cochran_q(matrix: ArrayLike | int | float, period: int, *, phases: ArrayLike | None = None) -> TestResult:
    """Paired nested test: do the M residues explain more than their phases mod ``period``?

    The paired counterpart of :func:`~phaselens.stats.periodicity.nested_fold_test`: the sum over the P classes
    of residues sharing r mod P of Cochran's Q within the class, referred to χ² with Σ(k − 1) df over the
    classes that have a discordant item (M − P when all do). With two residues per class each term is
    McNemar's statistic.

    Args:
        matrix: ``(items, M)`` 0/1 outcomes, item i at residue r.
        period: P dividing M. P = M leaves nothing to test (df 0, p 1).
        phases: for a matrix over a subset of residues, ``(K,)`` the phase of each column: classes are the
            phases present, of any sizes, with Σ(k_p − 1) df over the informative ones (default: the columns
            are residues 0..M−1).

    Example:
        >>> x = np.array([[1, 0, 0, 0], [1, 1, 0, 1], [1, 0, 0, 0], [1, 0, 1, 0], [0, 1, 1, 0]])
        >>> nested_cochran_q(x, 2)  # McNemar 1.0 for residues {0, 2} plus 1.0 for {1, 3}
        TestResult(nested_cochran_4_vs_2: statistic=2, df=2, p=0.368)
    """
    x = binary_matrix(matrix)
    m = x.shape[1]
    if phases is not None:
        ph = np.asarray(phases).ravel()
        if ph.size != m or ph.dtype.kind not in "iu":
            raise StatsInputError(f"phases must give one integer phase per column ({m}), got {ph.tolist()!r}.")
        present, codes = np.unique(ph, return_inverse=True)
        q, informative, size = stratified_q_by(x, codes, present.size)
        df = int(((size - 1) * informative).sum())
        name = f"nested_cochran_{m}_vs_{present.size}"
        stat = float(q.sum())
        return TestResult(name, stat if df else 0.0, df, float(stats.chi2.sf(stat, df)) if df else 1.0)
    period = check_period(period, m)
    name = f"nested_cochran_{m}_vs_{period}"
    if period == m:
        return TestResult(name, 0.0, 0, 1.0)
    q, informative = stratified_q(x, period)
    df = int(informative.sum()) * (m // period - 1)
    if df == 0:
        return TestResult(name, 0.0, 0, 1.0)
    stat = float(q.sum())
    return TestResult(name, stat, df, float(stats.chi2.sf(stat, df)))

