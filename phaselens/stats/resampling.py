"""Permutation nulls for the folded max−min gap.

The max−min gap over phases is biased upward: even with no phase effect it is positive. These functions give
it a null (permutations); its interval lives in :mod:`phaselens.stats.gapci`. Every draw is batched: permuted
tables come from one multivariate-hypergeometric call, within-item permutations from ``Generator.permuted`` on
a stacked array.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_counts, check_draws, check_stride
from phaselens.stats.folding import fold, fold_by, folded_gap_from_counts, gap
from phaselens.stats.outcomes import PermutationResult

_CHUNK_ELEMENTS = 1 << 22  # cap on elements per batched draw (32 MB of float64)


def permutation_pvalue(observed: float, null: np.ndarray) -> float:
    """``(1 + #{null >= observed}) / (B + 1)`` for a statistic where large is extreme; NaN if observed is NaN.

    A tiny relative tolerance counts ties that differ only by rounding (gaps are ratios of integers).
    """
    if not np.isfinite(observed):
        return float("nan")
    tol = 1e-12 * max(1.0, abs(observed))
    return float((1 + np.count_nonzero(null >= observed - tol)) / (null.size + 1))


def permuted_correct(
    c: np.ndarray, t: np.ndarray, n_permutations: int, rng: np.random.Generator
) -> np.ndarray:
    """Correct counts ``(B, M)`` of tables whose pooled outcomes were permuted across residues.

    Shuffling the N = Σ n outcomes over the residue slots (n per residue fixed) and counting the correct ones
    per residue is a multivariate hypergeometric draw of Σ correct from "colours" of sizes n.
    """
    return rng.multivariate_hypergeometric(t, int(c.sum()), size=n_permutations)


def _folder(width: int, stride: int, phases: ArrayLike | None) -> tuple[Callable[[np.ndarray], np.ndarray], np.ndarray]:
    """How to fold ``width`` columns onto phases, and how many columns each phase holds.

    ``phases=None``: the columns are residues 0..M−1 (M = ``width``) and fold mod ``stride``. Otherwise
    ``phases`` ``(width,)`` gives each column's phase (a subset of residues; see :mod:`phaselens.stats.subset`).
    """
    if phases is None:
        stride, _ = check_stride(stride, width)
        return (lambda x: fold(x, stride)), np.full(stride, width // stride)
    ph = np.asarray(phases).ravel()
    if ph.size != width or ph.dtype.kind not in "iu":
        raise StatsInputError(f"phases must give one integer phase per column ({width}), got {ph.tolist()!r}.")
    present, codes = np.unique(ph, return_inverse=True)
    return (lambda x: fold_by(x, codes, present.size)), np.bincount(codes)


def gap_permutation_test(
    correct: ArrayLike | int | float, n: ArrayLike | int | float, stride: int, *, n_permutations: int = 9999,
    seed: int = 0, phases: ArrayLike | None = None,
) -> PermutationResult:
    """Unpaired permutation test of the folded max−min gap.

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        stride: S; residues are folded mod S by summing counts.
        n_permutations: permuted tables.
        seed: seed for ``np.random.default_rng``.
        phases: for counts over a subset of residues, ``(K,)`` the phase of each column; the gap is then
            taken over the phases present (default: the columns are residues 0..M−1).

    Example:
        >>> r = gap_permutation_test([112, 178, 169, 76, 115, 179, 165, 84], 256, 4, n_permutations=999)
        >>> round(r.statistic, 4), r.pvalue
        (0.3848, 0.001)
    """
    c, t = check_counts(correct, n)
    b = check_draws(n_permutations, "n_permutations")
    if phases is None:
        stride, _ = check_stride(stride, c.shape[-1])
        observed = float(folded_gap_from_counts(c, t, stride))
        null = folded_gap_from_counts(permuted_correct(c, t, b, np.random.default_rng(seed)), t, stride)
    else:
        f, _ = _folder(c.shape[-1], stride, phases)
        observed = float(gap(f(c) / f(t)))
        null = gap(f(permuted_correct(c, t, b, np.random.default_rng(seed))) / f(t))
    return PermutationResult(
        "folded_gap", observed, permutation_pvalue(observed, null), b, float(null.mean()), "unpaired"
    )


def within_item_permutation_test(
    matrix: ArrayLike | int | float,
    stride: int,
    *,
    n_permutations: int = 9999,
    seed: int = 0,
    name: str = "folded_gap",
    phases: ArrayLike | None = None,
) -> PermutationResult:
    """Paired permutation test of the folded max−min gap: each item's outcomes are shuffled across residues.

    Items differ in difficulty; shuffling inside items keeps that difficulty out of the null, which makes the
    test sharper than :func:`gap_permutation_test` when items repeat across residues.

    Args:
        matrix: ``(items, M)`` outcomes, item i at residue r (0/1 correctness or a continuous metric).
        stride: S (divides M).
        n_permutations: permutations drawn.
        seed: seed for ``np.random.default_rng``.
        name: label of the statistic in the result.
        phases: for a matrix over a subset of residues, ``(K,)`` the phase of each column; the gap is then
            taken over the phases present (default: the columns are residues 0..M−1).

    Returns:
        A :class:`PermutationResult` whose statistic is the max−min of phase means.
    """
    x = np.asarray(matrix, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise StatsInputError(f"matrix must be 2-D [items, residues] and non-empty, got shape {x.shape}.")
    if not np.all(np.isfinite(x)):
        raise StatsInputError("matrix contains NaN or inf; drop or impute those items first.")
    f, per_phase = _folder(x.shape[1], stride, phases)
    b = check_draws(n_permutations, "n_permutations")
    rng = np.random.default_rng(seed)
    if phases is None:  # equal rows per phase: fold the sums, scale once
        scale = x.shape[0] * (x.shape[1] // stride)

        def stat(a: np.ndarray) -> np.ndarray:
            return gap(f(a.sum(axis=-2))) / scale
    else:
        rows = x.shape[0] * per_phase  # rows per phase, to turn sums into means

        def stat(a: np.ndarray) -> np.ndarray:
            return gap(f(a.sum(axis=-2)) / rows)
    observed = float(stat(x))
    chunk = max(1, _CHUNK_ELEMENTS // x.size)
    null = np.concatenate(
        [stat(rng.permuted(np.broadcast_to(x, (k, *x.shape)), axis=-1)) for k in np.diff(np.r_[0:b:chunk, b])]
    )
    return PermutationResult(
        name, observed, permutation_pvalue(observed, null), b, float(null.mean()), "within-item"
    )
