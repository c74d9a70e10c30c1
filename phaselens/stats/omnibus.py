"""Omnibus tests of "accuracy does not depend on residue".

* :func:`chi2_test`, :func:`g_test`: Pearson χ² and likelihood-ratio G on the 2 × R table (correct, wrong) ×
  residue, df = R − 1. :func:`chi2_statistic` and :func:`g_statistic` compute the same statistics for a whole
  batch of tables at once (simulations).
* :func:`cochran_q`: the same question when the same items appear at every residue (paired 0/1 outcomes).
* :func:`cmh_test`: the generalized Cochran–Mantel–Haenszel general-association test across strata.

A table with no wrong (or no correct) answers at all has no variation to explain: its statistics are 0 and
its p-value is 1.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import special, stats

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_counts
from phaselens.stats.outcomes import TestResult


def _expected(c: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expected correct and wrong counts ``(..., R)`` under a common accuracy per table."""
    p = c.sum(axis=-1, keepdims=True) / t.sum(axis=-1, keepdims=True)
    return t * p, t * (1.0 - p)


def chi2_statistic(correct: ArrayLike | int | float, n: ArrayLike | int | float) -> np.ndarray:
    """Pearson χ² of each 2 × R table in a batch.

    Args:
        correct: ``(..., R)`` correct answers per residue.
        n: an int or ``(..., R)`` trials per residue.

    Returns:
        ``(...)`` statistics (df = R − 1 each); 0 for tables that are all correct or all wrong.
    """
    c, t = check_counts(correct, n)
    e1, e0 = _expected(c, t)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = (c - e1) ** 2 / e1 + ((t - c) - e0) ** 2 / e0
    return np.nan_to_num(terms, nan=0.0, posinf=0.0).sum(axis=-1)


def g_statistic(correct: ArrayLike | int | float, n: ArrayLike | int | float) -> np.ndarray:
    """Likelihood-ratio G = 2 Σ O ln(O / E) of each 2 × R table in a batch: the arguments and the ``(...)``
    statistics as in :func:`chi2_statistic` (df = R − 1; 0 for tables all correct or all wrong)."""
    c, t = check_counts(correct, n)
    e1, e0 = _expected(c, t)
    w = t - c
    # xlogy gives 0 for an empty cell; an empty cell's expectation may be 0 too, so silence 0/0.
    with np.errstate(divide="ignore", invalid="ignore"):
        g = 2.0 * (special.xlogy(c, c / e1) + special.xlogy(w, w / e0))
    return np.nan_to_num(g, nan=0.0).sum(axis=-1)


def _table_test(correct: ArrayLike | int | float, n: ArrayLike | int | float, lambda_: str | None, name: str) -> TestResult:
    c, t = check_counts(correct, n)
    if c.ndim != 1:
        raise StatsInputError(
            f"{name}_test takes one table (correct of shape (R,)), got shape {c.shape}; "
            f"use {name}_statistic for batches."
        )
    df = c.size - 1
    if df == 0 or c.sum() in (0, t.sum()):
        return TestResult(name, 0.0, df, 1.0)
    table = np.stack([c, t - c])
    res = stats.chi2_contingency(table, correction=False, lambda_=lambda_)
    return TestResult(name, float(res.statistic), int(res.dof), float(res.pvalue))


def chi2_test(correct: ArrayLike | int | float, n: ArrayLike | int | float) -> TestResult:
    """Pearson χ² test on the 2 × R table (correct, wrong) × residue.

    Args:
        correct: ``(R,)`` correct answers per residue.
        n: an int or ``(R,)`` trials per residue.

    Example:
        >>> chi2_test([112, 178, 169, 76, 115, 179, 165, 84], 256)
        TestResult(chi2: statistic=201.4, df=7, p=5.90e-40)
    """
    return _table_test(correct, n, None, "chi2")


def g_test(correct: ArrayLike | int | float, n: ArrayLike | int | float) -> TestResult:
    """Likelihood-ratio G test on the 2 × R table (correct, wrong) × residue.

    Args:
        correct: ``(R,)`` correct answers per residue.
        n: an int or ``(R,)`` trials per residue.
    """
    return _table_test(correct, n, "log-likelihood", "g")


def _binary_matrix(matrix: ArrayLike | int | float) -> np.ndarray:
    x = np.asarray(matrix)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 2:
        raise StatsInputError(
            f"cochran_q needs a 2-D matrix [items, residues] with at least 2 residues, got shape {x.shape}."
        )
    if x.dtype.kind not in "biuf" or not np.all((x == 0) | (x == 1)):
        raise StatsInputError("cochran_q needs 0/1 (or bool) outcomes; threshold continuous scores first.")
    return x.astype(np.int64)


def cochran_q(matrix: ArrayLike | int | float) -> TestResult:
    """Cochran's Q for paired binary outcomes: each item answered once at every residue.

    Q = (k − 1) (k Σ_j C_j² − N²) / (k N − Σ_i R_i²), with column (residue) totals C_j, row (item) totals R_i,
    grand total N and k residues; referred to χ² with k − 1 df. On 0/1 data it equals Friedman's test with
    the tie correction (``scipy.stats.friedmanchisquare``). Items right (or wrong) everywhere carry no
    information and cancel out.

    Args:
        matrix: ``(items, k)`` of 0/1 or bool.

    Example:
        >>> cochran_q([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
        TestResult(cochran_q: statistic=4.667, df=2, p=0.097)
    """
    x = _binary_matrix(matrix)
    k = x.shape[1]
    col, row = x.sum(axis=0), x.sum(axis=1)
    total = int(col.sum())
    denom = k * total - int((row**2).sum())
    if denom == 0:
        return TestResult("cochran_q", 0.0, k - 1, 1.0)
    q = (k - 1) * (k * int((col**2).sum()) - total**2) / denom
    return TestResult("cochran_q", float(q), k - 1, float(stats.chi2.sf(q, k - 1)))


def cmh_test(tables: ArrayLike | int | float) -> TestResult:
    """Generalized Cochran–Mantel–Haenszel test of general association, across strata.

    Each stratum h is an I × J table (here usually 2 × R: correct/wrong × residue). Conditional on its
    margins, the (I−1)(J−1) leading cells n_h have mean m_h = N_h r_h ⊗ c_h and covariance
    V_h = N_h² / (N_h − 1) · (diag r_h − r_h r_hᵀ) ⊗ (diag c_h − c_h c_hᵀ) (row and column shares r_h, c_h,
    truncated to their leading I−1 and J−1 entries). The statistic is Q = dᵀ V⁻ d with d = Σ_h (n_h − m_h),
    V = Σ_h V_h, referred to χ² with rank(V) df ((I−1)(J−1) when no row or column is empty throughout).
    With one stratum Q = (N − 1)/N · Pearson χ².

    Args:
        tables: ``(strata, I, J)`` non-negative counts, e.g. ``(strata, 2, R)``.
    """
    x = np.asarray(tables)
    if x.ndim != 3 or min(x.shape) < 1 or x.shape[1] < 2 or x.shape[2] < 2:
        raise StatsInputError(
            f"cmh_test needs tables of shape (strata, I, J) with I, J >= 2, got {x.shape}; "
            "for one table pass tables[None]."
        )
    if x.dtype.kind not in "iuf" or np.any(x < 0) or not np.all(x == np.round(x)):
        raise StatsInputError("cmh_test needs non-negative whole counts in every cell.")
    x = x.astype(np.float64)
    big = x.sum(axis=(1, 2))
    x = x[big > 1]  # a stratum with at most one observation has no conditional variance
    if x.shape[0] == 0:
        raise StatsInputError("every stratum has fewer than 2 observations; cmh_test has nothing to test.")
    big = big[big > 1][:, None]
    i, j = x.shape[1] - 1, x.shape[2] - 1
    r = x.sum(axis=2) / big  # (H, I) row shares
    c = x.sum(axis=1) / big  # (H, J) column shares
    d = (x[:, :i, :j] - big[:, :, None] * r[:, :i, None] * c[:, None, :j]).sum(axis=0).ravel()
    vr = np.einsum("hi,ik->hik", r[:, :i], np.eye(i)) - r[:, :i, None] * r[:, None, :i]
    vc = np.einsum("hj,jk->hjk", c[:, :j], np.eye(j)) - c[:, :j, None] * c[:, None, :j]
    scale = (big[:, 0] ** 2 / (big[:, 0] - 1.0))[:, None, None, None, None]
    v = (scale * vr[:, :, None, :, None] * vc[:, None, :, None, :]).sum(axis=0).reshape(i * j, i * j)
    df = int(np.linalg.matrix_rank(v))
    if df == 0:
        return TestResult("cmh", 0.0, 0, 1.0)
    q = float(d @ np.linalg.pinv(v, hermitian=True) @ d)
    return TestResult("cmh", q, df, float(stats.chi2.sf(q, df)))
