"""Permutation nulls and bootstrap intervals for the folded max−min gap.

The max−min gap over phases is biased upward: even with no phase effect it is positive. These functions give
it a null (permutations) and an uncertainty (bootstrap). Every draw is batched: permuted tables come from one
multivariate-hypergeometric call, within-item permutations from ``Generator.permuted`` on a stacked array,
bootstrap replicates from multinomial item weights times an item × residue matrix.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from phaselens.errors import StatsInputError
from phaselens.stats._checks import (
    check_counts,
    check_draws,
    check_level,
    check_stride,
    check_values,
    resolve_residues,
)
from phaselens.stats.folding import fold, folded_gap_from_counts, gap
from phaselens.stats.items import item_codes
from phaselens.stats.results import BootstrapResult, PermutationResult

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


def gap_permutation_test(
    correct: ArrayLike | int | float, n: ArrayLike | int | float, stride: int, *, n_permutations: int = 9999, seed: int = 0
) -> PermutationResult:
    """Unpaired permutation test of the folded max−min gap.

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        stride: S; residues are folded mod S by summing counts.
        n_permutations: permuted tables.
        seed: seed for ``np.random.default_rng``.

    Example:
        >>> r = gap_permutation_test([112, 178, 169, 76, 115, 179, 165, 84], 256, 4, n_permutations=999)
        >>> round(r.statistic, 4), r.pvalue
        (0.3848, 0.001)
    """
    c, t = check_counts(correct, n)
    stride, _ = check_stride(stride, c.shape[-1])
    b = check_draws(n_permutations, "n_permutations")
    observed = float(folded_gap_from_counts(c, t, stride))
    null = folded_gap_from_counts(permuted_correct(c, t, b, np.random.default_rng(seed)), t, stride)
    return PermutationResult(
        "folded_gap", observed, permutation_pvalue(observed, null), b, float(null.mean()), "unpaired"
    )


def _phase_sum_gap(matrix: np.ndarray, stride: int) -> np.ndarray:
    """Folded gap of ``(..., items, M)`` matrices, in sums: divide by the rows per phase for means."""
    return gap(fold(matrix.sum(axis=-2), stride))


def within_item_permutation_test(
    matrix: ArrayLike | int | float,
    stride: int,
    *,
    n_permutations: int = 9999,
    seed: int = 0,
    name: str = "folded_gap",
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

    Returns:
        A :class:`PermutationResult` whose statistic is the max−min of phase means.
    """
    x = np.asarray(matrix, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise StatsInputError(f"matrix must be 2-D [items, residues] and non-empty, got shape {x.shape}.")
    if not np.all(np.isfinite(x)):
        raise StatsInputError("matrix contains NaN or inf; drop or impute those items first.")
    stride, _ = check_stride(stride, x.shape[1])
    b = check_draws(n_permutations, "n_permutations")
    rng = np.random.default_rng(seed)
    scale = x.shape[0] * (x.shape[1] // stride)  # rows per phase, to turn sums into means
    observed = float(_phase_sum_gap(x, stride)) / scale
    chunk = max(1, _CHUNK_ELEMENTS // x.size)
    null = np.concatenate(
        [
            _phase_sum_gap(rng.permuted(np.broadcast_to(x, (k, *x.shape)), axis=-1), stride) / scale
            for k in np.diff(np.r_[0:b:chunk, b])
        ]
    )
    return PermutationResult(
        name, observed, permutation_pvalue(observed, null), b, float(null.mean()), "within-item"
    )


def _bootstrap_result(
    name: str, estimate: float, boots: np.ndarray, level: float, scheme: str
) -> BootstrapResult:
    ok = boots[np.isfinite(boots)]
    if ok.size == 0:
        raise StatsInputError("no bootstrap replicate had data at every phase; collect more items per phase.")
    lo, hi = np.quantile(ok, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return BootstrapResult(
        name, estimate, float(lo), float(hi), level, boots.size, boots.size - ok.size, scheme
    )


def gap_bootstrap_ci(
    correct: ArrayLike | int | float,
    n: ArrayLike | int | float,
    stride: int,
    *,
    level: float = 0.95,
    n_bootstrap: int = 2000,
    seed: int = 0,
) -> BootstrapResult:
    """Percentile bootstrap CI of the folded gap from counts; each trial is an item, resampled in its residue.

    Resampling n_r trials with replacement inside residue r is a Binomial(n_r, correct_r / n_r) draw.

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        stride: S (divides M).
        level: confidence level.
        n_bootstrap: replicates.
        seed: seed for ``np.random.default_rng``.
    """
    c, t = check_counts(correct, n)
    stride, _ = check_stride(stride, c.shape[-1])
    level = check_level(level)
    b = check_draws(n_bootstrap, "n_bootstrap")
    boots = folded_gap_from_counts(
        np.random.default_rng(seed).binomial(t, c / t, size=(b, c.size)), t, stride
    )
    return _bootstrap_result(
        "folded_gap", float(folded_gap_from_counts(c, t, stride)), boots, level, "within-residue"
    )


def item_bootstrap_ci(
    item_ids: ArrayLike | int | float,
    residues: ArrayLike | int | float,
    values: ArrayLike | int | float,
    stride: int,
    modulus: int | None = None,
    *,
    level: float = 0.95,
    n_bootstrap: int = 2000,
    seed: int = 0,
) -> BootstrapResult:
    """Item-cluster percentile bootstrap CI of the folded gap (max − min of phase means).

    When items cross residues (the same item at several residues), whole items are resampled with
    replacement, so their correlated outcomes travel together. When every item sits at a single residue,
    items are resampled within their residue, keeping each residue's size fixed.

    Args:
        item_ids: ``(N,)`` item label per row (any hashable values).
        residues: ``(N,)`` residue per row, in 0..M−1.
        values: ``(N,)`` outcome per row (0/1 or a continuous metric).
        stride: S (divides M).
        modulus: M; default ``max(residues) + 1`` rounded up to a multiple of S.
        level: confidence level.
        n_bootstrap: replicates; those in which a phase has no rows are dropped and counted.
        seed: seed for ``np.random.default_rng``.
    """
    r, stride, modulus = resolve_residues(residues, stride, modulus)
    v = check_values(values, "values", r.size)
    item = item_codes(item_ids, r.size)
    level = check_level(level)
    b = check_draws(n_bootstrap, "n_bootstrap")
    n_items = int(item.max()) + 1
    sums = np.zeros((n_items, modulus))
    counts = np.zeros((n_items, modulus))
    np.add.at(sums, (item, r), v)
    np.add.at(counts, (item, r), 1.0)
    phase_rows = fold(counts.sum(axis=0), stride)
    if np.any(phase_rows == 0):
        empty = np.flatnonzero(phase_rows == 0).tolist()
        raise StatsInputError(
            f"phases {empty} (mod {stride}) have no rows; every phase needs data for a gap."
        )
    rng = np.random.default_rng(seed)
    if np.all((counts > 0).sum(axis=1) == 1):
        scheme = "within-residue"
        w_sums = np.zeros((b, modulus))
        w_counts = np.zeros((b, modulus))
        for res in range(modulus):  # one batched draw per residue, not per replicate
            members = np.flatnonzero(counts[:, res] > 0)
            if members.size:
                w = rng.multinomial(members.size, np.full(members.size, 1.0 / members.size), size=b)
                w_sums += w @ sums[members]
                w_counts += w @ counts[members]
    else:
        scheme = "item-cluster"
        w = rng.multinomial(n_items, np.full(n_items, 1.0 / n_items), size=b).astype(np.float64)
        w_sums, w_counts = w @ sums, w @ counts
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = gap(fold(w_sums, stride) / fold(w_counts, stride))
    estimate = float(gap(fold(sums.sum(axis=0), stride) / phase_rows))
    return _bootstrap_result("folded_gap", estimate, boots, level, scheme)
