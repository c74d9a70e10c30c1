"""Is the residue effect periodic with period S, and what is the period when S is unknown?

* :func:`nested_fold_test`: G on the table mod M minus G on the table folded mod P (P divides M). It is the
  likelihood-ratio test of "accuracy depends on the residue only through residue mod P", df = M − P.
  Not rejecting means mod M adds nothing to mod P.
* :func:`harmonic_fraction`: the share of the non-DC DFT power of the M per-residue accuracies that sits at
  the frequencies of period S (bins that are nonzero multiples of M/S). A purely S-periodic profile gives 1;
  with no structure each of the M − 1 non-DC bins holds the same power on average, so the reference share is
  (S − 1)/(M − 1). The permutation null's own mean is near it but not equal to it (a mean of ratios is not the
  ratio of means, and unequal n per residue shifts it further); the p-value uses the permutation null.

The period detector that builds on these tests lives in :mod:`phaselens.stats.period`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy import stats

from phaselens.stats._checks import (
    check_counts,
    check_draws,
    check_period,
    check_stride,
    readonly,
)
from phaselens.stats.folding import fold
from phaselens.stats.omnibus import g_statistic
from phaselens.stats.outcomes import TestResult, fmt_p
from phaselens.stats.resampling import permutation_pvalue, permuted_correct


def nested_fold_statistic(correct: ArrayLike | int | float, n: ArrayLike | int | float, period: int) -> np.ndarray:
    """G(mod M) − G(folded mod ``period``) for a batch of tables.

    Args:
        correct: ``(..., M)`` correct answers per residue.
        n: an int or ``(..., M)`` trials per residue.
        period: a divisor P of M.

    Returns:
        ``(...)`` statistics, each referred to χ² with M − P df; never negative.
    """
    c, t = check_counts(correct, n)
    period = check_period(period, c.shape[-1])
    d = g_statistic(c, t) - g_statistic(fold(c, period), fold(t, period))
    return np.maximum(d, 0.0)  # nested likelihood ratios are >= 0; clip rounding


def nested_fold_test(correct: ArrayLike | int | float, n: ArrayLike | int | float, period: int) -> TestResult:
    """Does the full residue table (mod M) explain more than the table folded mod ``period``?

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        period: a divisor P of M. P = M gives df = 0 and p = 1 (nothing left to test).

    Returns:
        ``TestResult("nested_fold_{M}_vs_{P}", G_M − G_P, M − P, p)``.

    Example:
        >>> nested_fold_test([112, 178, 169, 76, 115, 179, 165, 84], 256, 4)
        TestResult(nested_fold_8_vs_4: statistic=0.8003, df=4, p=0.938)
    """
    c, t = check_counts(correct, n)
    m = c.shape[-1]
    stat = float(nested_fold_statistic(c, t, period))
    df = m - int(period)
    p = 1.0 if df == 0 else float(stats.chi2.sf(stat, df))
    return TestResult(f"nested_fold_{m}_vs_{period}", stat if df else 0.0, df, p)


def harmonic_statistic(accuracy: ArrayLike | int | float, stride: int) -> np.ndarray:
    """Harmonic-energy fraction of a batch of accuracy profiles.

    Args:
        accuracy: ``(..., M)`` per-residue accuracies (M a multiple of ``stride``).
        stride: the period S.

    Returns:
        ``(...)`` fractions in [0, 1]; NaN for a flat profile (no non-DC power).
    """
    a = np.asarray(accuracy, dtype=np.float64)
    stride, m = check_stride(stride, a.shape[-1])
    power = np.abs(np.fft.fft(a, axis=-1)) ** 2
    periodic = power[..., m // stride :: m // stride].sum(axis=-1)
    total = power[..., 1:].sum(axis=-1)
    # Relative threshold: a flat profile leaves only rounding noise in the non-DC bins.
    flat = total <= 1e-20 * np.maximum(power[..., 0], 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(flat, np.nan, periodic / np.where(flat, 1.0, total))


@dataclass(frozen=True, repr=False, eq=False)
class HarmonicResult:
    """Harmonic-energy fraction with its null.

    Attributes:
        fraction: observed share of non-DC power at period-S frequencies (NaN for a flat profile).
        null_fraction: (S − 1)/(M − 1), the share of non-DC bins at period-S frequencies: the reference value
            with no structure (each bin's expected power is equal), not the null's exact mean.
        null_mean: the fraction's mean over the permuted tables (near ``null_fraction`` with equal n per
            residue, further off with unequal n); the p-value comes from this null.
        pvalue: permutation p-value (outcomes permuted across residues, n per residue fixed).
        n_permutations: permutations drawn.
        stride, modulus: S and M.
        power: ``(M,)`` DFT power of the accuracy profile, bin 0 (DC) first.
    """

    fraction: float
    null_fraction: float
    null_mean: float
    pvalue: float
    n_permutations: int
    stride: int
    modulus: int
    power: np.ndarray

    def __post_init__(self) -> None:
        readonly(self.power)

    def to_frame(self) -> pd.DataFrame:
        """One row: ``test``, ``statistic`` (the harmonic fraction), ``null_fraction``, ``null_mean``, ``pvalue``,
        ``n_permutations``."""
        row = dict(test="harmonic_fraction", statistic=self.fraction, null_fraction=self.null_fraction,
                   null_mean=self.null_mean, pvalue=self.pvalue, n_permutations=self.n_permutations)
        return pd.DataFrame([row])

    def __repr__(self) -> str:
        return (
            f"HarmonicResult(period {self.stride} of {self.modulus}: fraction={self.fraction:.4f}, "
            f"null={self.null_fraction:.4f}, p={fmt_p(self.pvalue)}, B={self.n_permutations})"
        )


def harmonic_fraction(
    correct: ArrayLike | int | float, n: ArrayLike | int | float, stride: int, *, n_permutations: int = 9999, seed: int = 0
) -> HarmonicResult:
    """Share of the residue profile's variation that is periodic with period ``stride``, with a p-value.

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        stride: the period S (divides M).
        n_permutations: permuted tables to draw.
        seed: seed for ``np.random.default_rng``.

    Example:
        >>> r = harmonic_fraction([112, 178, 169, 76, 115, 179, 165, 84], 256, 4, n_permutations=999)
        >>> round(r.fraction, 3), round(r.null_fraction, 3), r.pvalue
        (0.996, 0.429, 0.001)
    """
    c, t = check_counts(correct, n)
    stride, m = check_stride(stride, c.shape[-1])
    b = check_draws(n_permutations, "n_permutations")
    a = c / t
    observed = float(harmonic_statistic(a, stride))
    null = harmonic_statistic(permuted_correct(c, t, b, np.random.default_rng(seed)) / t, stride)
    return HarmonicResult(
        fraction=observed,
        null_fraction=(stride - 1) / (m - 1) if m > 1 else float("nan"),
        null_mean=float(np.nanmean(null)) if np.any(np.isfinite(null)) else float("nan"),
        pvalue=permutation_pvalue(observed, null),
        n_permutations=b,
        stride=stride,
        modulus=m,
        power=np.abs(np.fft.fft(a)) ** 2,
    )
