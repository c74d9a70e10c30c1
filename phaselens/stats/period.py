"""The period of a residue effect when the stride is unknown, chosen with stated error rates.

Hypothesis H_P (P divides M): accuracy depends on the residue only through r mod P. H_M always holds, H_1 is
"no effect", and the true period is the smallest P whose H_P holds. The detector never reads a test's
non-rejection as evidence:

1. **Omnibus** (G on the 2 × M table; Cochran's Q for paired items) at α. No rejection: no period.
2. **Closed testing** over the lattice of divisors: H_P is rejected when its own nested test (M vs P) and the
   tests of every divisor of P reject. The non-rejected periods are the ``candidates``; all true H_P survive
   with probability ≥ 1 − α.
3. **Evidence for the smallest candidate P.** The profile splits into a P-periodic part (the P-folded
   profile's spread, energy E) and a departure (a_r − ā_(r mod P), energy D); the Wald statistics of the two
   are independent with noncentralities ∝ E and D. P is identified only when the periodic part carries at
   least ``min_share`` of the variation with confidence: upper bound on D ≤ (1 − s)/s × lower bound on E,
   each bound inverted from a noncentral χ² at 1 − α/2. Otherwise the data cannot single out a period:
   ``period`` is None, ``status`` "ambiguous", and ``candidates`` lists every period they cannot reject.

Error rates (each ≤ α, up to the χ² approximations; docs/statistics.md shows them by simulation):

* a period is reported when there is no effect (step 1);
* the reported period is a proper multiple of the true one (step 2: H_true would have to be rejected);
* the reported period P explains less than ``min_share`` of the true profile's variation (E/(E + D), in
  standard-error units) (step 3: one of the two bounds would have to fail). A period that does not divide the
  truth's explains little of it, so the wrong-but-smaller answers of a sequential search are covered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy import optimize, stats

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_alpha, check_counts
from phaselens.stats.contrasts import count_moments, item_moments
from phaselens.stats.omnibus import cochran_q, g_test
from phaselens.stats.outcomes import TestResult, fmt_p
from phaselens.stats.paired import binary_matrix, nested_cochran_q
from phaselens.stats.periodicity import nested_fold_test

STATUSES = ("no effect", "identified", "ambiguous")


@dataclass(frozen=True, repr=False)
class PeriodResult:
    """Outcome of :func:`detect_period` / :func:`detect_period_paired`.

    Attributes:
        period: the identified period, or ``None`` (no effect, or a period the data cannot single out).
        omnibus: the omnibus test on the full table.
        nested: the nested test (M vs P) of every divisor 2 ≤ P < M, smallest first.
        alpha: the level used.
        modulus: M.
        candidates: periods not rejected by closed testing (empty when there is no effect; just the period
            when one is identified): the periods the data cannot tell apart.
        status: ``"no effect"``, ``"identified"`` or ``"ambiguous"``.
        min_share: share of the variation the periodic part must carry (step 3).
        checks: ``(P, departure_upper, effect_lower)`` noncentrality bounds for each smallest candidate
            examined in step 3.
    """

    period: int | None
    omnibus: TestResult
    nested: tuple[TestResult, ...]
    alpha: float
    modulus: int
    candidates: tuple[int, ...] = ()
    status: str = "no effect"
    min_share: float = 0.5
    checks: tuple[tuple[int, float, float], ...] = ()

    def to_frame(self) -> pd.DataFrame:
        """One row per hypothesis: ``candidate_period`` (None for the omnibus), the test, whether closed
        testing rejects it, whether it is a candidate, and the step-3 bounds where examined."""
        rejected = _closed(self.omnibus, {int(t.name.rsplit("_", 1)[1]): t for t in self.nested}, self.modulus,
                           self.alpha)
        checks = {p: (d, e) for p, d, e in self.checks}
        rows = [dict(candidate_period=None, test=self.omnibus.name, statistic=self.omnibus.statistic,
                     df=self.omnibus.df, pvalue=self.omnibus.pvalue, rejects=self.omnibus.rejects(self.alpha))]
        for t in self.nested:
            p = int(t.name.rsplit("_", 1)[1])
            rows.append(dict(candidate_period=p, test=t.name, statistic=t.statistic, df=t.df, pvalue=t.pvalue,
                             rejects=rejected.get(p, False)))
        frame = pd.DataFrame(rows)
        frame["candidate"] = frame["candidate_period"].isin(self.candidates)
        frame["departure_upper"] = frame["candidate_period"].map(lambda p: checks.get(p, (np.nan,))[0])
        frame["effect_lower"] = frame["candidate_period"].map(lambda p: checks.get(p, (np.nan, np.nan))[1])
        return frame.astype({"candidate_period": "Int64"})

    def __repr__(self) -> str:
        steps = ", ".join(f"P={t.name.rsplit('_', 1)[1]}: p={fmt_p(t.pvalue)}" for t in self.nested)
        cands = ", ".join(map(str, self.candidates))
        return (
            f"PeriodResult(period={self.period}, {self.status}"
            + (f", candidates ({cands})" if self.status == "ambiguous" else "")
            + f"; omnibus p={fmt_p(self.omnibus.pvalue)}"
            + (f"; {steps}" if steps else "")
            + f"; alpha={self.alpha})"
        )


def divisors(m: int) -> list[int]:
    """Divisors 2 ≤ P ≤ M of M, increasing."""
    return [d for d in range(2, m + 1) if m % d == 0]


def _closed(omnibus: TestResult, local: dict[int, TestResult], m: int, alpha: float) -> dict[int, bool]:
    """Closed-testing rejections: H_P falls when the omnibus, its own test and every divisor's test reject."""
    out: dict[int, bool] = {}
    for d in divisors(m):
        own = d < m and local[d].rejects(alpha)
        out[d] = bool(omnibus.rejects(alpha) and own and all(out[e] for e in out if d % e == 0))
    return out


def _departure_matrix(weights: np.ndarray, period: int) -> np.ndarray:
    """``(M, M)`` map from residue values to their departures ``a_r − ā_(r mod P)`` (weighted class means)."""
    m = weights.size
    cls = np.arange(m) % period
    same = cls[:, None] == cls[None, :]
    w = np.where(same, weights[None, :], 0.0)
    return np.eye(m) - w / w.sum(axis=1, keepdims=True)


def _wald(x: np.ndarray, cov: np.ndarray) -> tuple[float, int]:
    """Wald statistic ``xᵀ cov⁺ x`` and the rank of ``cov`` (its degrees of freedom)."""
    w, q = np.linalg.eigh(cov)
    keep = w > 1e-10 * max(float(w.max()), 1e-300)
    proj = q[:, keep].T @ x
    return float((proj**2 / w[keep]).sum()), int(keep.sum())


def _nc_bound(stat: float, df: int, prob: float) -> float:
    """The noncentrality λ at which ``ncx2.cdf(stat, df, λ) = prob`` (0 when even λ = 0 falls short)."""
    if df == 0 or stats.chi2.cdf(stat, df) <= prob:
        return 0.0
    hi = stat + 10.0 * np.sqrt(stat + df) + 10.0
    while stats.ncx2.cdf(stat, df, hi) > prob:
        hi *= 2.0
    return float(optimize.brentq(lambda nc: stats.ncx2.cdf(stat, df, nc) - prob, 0.0, hi, xtol=1e-9 * hi))


def _evidence(est_m: np.ndarray, cov_m: np.ndarray, weights: np.ndarray, folded: Callable[[int], tuple],
              period: int, alpha: float) -> tuple[float, float]:
    """Upper bound on the departure's and lower bound on the folded effect's noncentrality (Wald, 1 − α/2).

    Args:
        est_m, cov_m: ``(M,)`` residue estimates and ``(M, M)`` covariance.
        weights: ``(M,)`` weights of the residues in their class means (trials or items per residue).
        folded: P ↦ ``(est, cov)`` of the P-folded profile.
    """
    a = _departure_matrix(weights, period)
    w_dep, df_dep = _wald(a @ est_m, a @ cov_m @ a.T)
    est_p, cov_p = folded(period)
    centre = np.eye(period) - 1.0 / period
    w_eff, df_eff = _wald(centre @ est_p, centre @ cov_p @ centre.T)
    return _nc_bound(w_dep, df_dep, alpha / 2), _nc_bound(w_eff, df_eff, 1 - alpha / 2)


def _decide(omnibus: TestResult, local: dict[int, TestResult], m: int, alpha: float, min_share: float,
            evidence: Callable[[int], tuple[float, float]]) -> PeriodResult:
    nested = tuple(local[d] for d in divisors(m) if d < m)
    if not omnibus.rejects(alpha):
        return PeriodResult(None, omnibus, nested, alpha, m, (), "no effect", min_share, ())
    rejected = _closed(omnibus, local, m, alpha)
    cands = [d for d in divisors(m) if not rejected[d]]
    smallest = [d for d in cands if not any(e < d and d % e == 0 for e in cands)]
    checks = tuple((d, *evidence(d)) for d in smallest)
    ratio = (1.0 - min_share) / min_share  # departure energy allowed per unit of periodic energy
    for d, dep, eff in checks:
        if eff > 0 and dep <= ratio * eff:
            return PeriodResult(d, omnibus, nested, alpha, m, (d,), "identified", min_share, checks)
    return PeriodResult(None, omnibus, nested, alpha, m, tuple(cands), "ambiguous", min_share, checks)


def _check_min_share(min_share: float) -> float:
    if not 0.0 < float(min_share) < 1.0:
        raise StatsInputError(f"min_share must lie strictly between 0 and 1, got {min_share}; e.g. 0.5.")
    return float(min_share)


def detect_period(
    correct: ArrayLike | int | float,
    n: ArrayLike | int | float,
    *,
    alpha: float = 0.05,
    min_share: float = 0.5,
) -> PeriodResult:
    """Find the period of a residue effect from per-residue counts (independent trials).

    See the module docstring for the procedure and its error rates.

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        alpha: level of every test and bound.
        min_share: share of the between-residue variation the period must explain (step 3); 0.5 by default.

    Example:
        >>> detect_period([112, 178, 169, 76, 115, 179, 165, 84], 256).period
        4
    """
    c, t = check_counts(correct, n)
    if c.ndim != 1:
        raise StatsInputError(f"correct must be 1-D, one count per residue, got shape {c.shape}.")
    alpha, min_share = check_alpha(alpha), _check_min_share(min_share)
    m = c.size
    est_m, cov_m = count_moments(c, t, m)
    local = {d: nested_fold_test(c, t, d) for d in divisors(m) if d < m}
    return _decide(
        g_test(c, t), local, m, alpha, min_share,
        lambda d: _evidence(est_m, cov_m, t.astype(np.float64), lambda p: count_moments(c, t, p), d, alpha),
    )


def detect_period_paired(
    matrix: ArrayLike | int | float,
    *,
    alpha: float = 0.05,
    min_share: float = 0.5,
) -> PeriodResult:
    """Find the period when every item is answered at every residue: the paired version of
    :func:`detect_period` (Cochran's Q omnibus, :func:`~phaselens.stats.paired.nested_cochran_q` nested tests,
    item-cluster covariances for the bounds).

    Args:
        matrix: ``(items, M)`` 0/1 outcomes.
        alpha, min_share: as in :func:`detect_period`.
    """
    x = binary_matrix(matrix)
    alpha, min_share = check_alpha(alpha), _check_min_share(min_share)
    m = x.shape[1]
    ones = np.ones(x.shape, dtype=np.float64)
    est_m, cov_m = item_moments(x, ones, binary=True)

    def folded(p: int) -> tuple[np.ndarray, np.ndarray]:
        s = x.reshape(x.shape[0], m // p, p).sum(axis=1)
        return item_moments(s, np.full(s.shape, m // p, dtype=np.float64), binary=True)

    local = {d: nested_cochran_q(x, d) for d in divisors(m) if d < m}
    return _decide(
        cochran_q(x), local, m, alpha, min_share,
        lambda d: _evidence(est_m, cov_m, np.full(m, float(x.shape[0])), folded, d, alpha),
    )
