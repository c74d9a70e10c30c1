"""Confidence bounds for the max − min gap over phases that hold at every profile, ties included.

The gap θ = max_p π_p − min_p π_p is the largest pairwise difference δ_jk = π_j − π_k. A percentile bootstrap of
the sample max − min inherits its upward bias (with no phase effect it covers 0 never). Here the bounds come
from the pairwise differences themselves:

* **Upper bound.** θ equals δ_jk for the true extreme pair (j*, k*), so ``max_{j≠k}(δ̂_jk + z se_jk)`` is at
  least θ whenever that one pair's own one-sided bound holds. A single normal quantile z is enough, whatever
  the ties: one-sided coverage ≥ the pair's, i.e. nominal.
* **Lower bound.** ``max_{j≠k}(δ̂_jk − c se_jk)`` stays below θ only if no pair's lower bound overshoots its
  own δ_jk, so c must hold for all pairs at once: the quantile of ``max_{j<k} |Z_j − Z_k| / se_jk`` with
  Z ~ N(0, V) (Tukey's studentized range over √2 when phases are independent with equal variances).

``ci_low``/``ci_high`` give each side (1 − level)/2, so the interval covers with probability ≥ level;
``upper_bound`` is the one-sided ``level`` upper bound, the equivalence margin. Estimates and covariances come
from :mod:`phaselens.stats.contrasts`. Coverage tables: docs/statistics.md (``python -m experiments.stats_simulations``).
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
    item_codes,
    resolve_residues,
)
from phaselens.stats.contrasts import (
    count_moments,
    item_moments,
    max_abs_t_quantiles,
    normal_quantile,
    pair_matrix,
)
from phaselens.stats.folding import fold, folded_gap_from_counts, gap
from phaselens.stats.outcomes import GapInterval

MIN_DRAWS = 20_000  # draws the batteries use at least: the critical value's MC SD is ≈ 0.01


def gap_bounds(
    est: np.ndarray, cov: np.ndarray, *, level: float = 0.95, n_draws: int = 20000, seed: int = 0
) -> dict[str, np.ndarray]:
    """Bounds on the max − min of the true values behind a batch of estimates.

    Args:
        est: ``(T, K)`` estimates (adjusted proportions or means), K ≥ 2.
        cov: ``(T, K, K)`` their covariance.
        level: two-sided confidence level of ``(low, high)``; ``upper`` is one-sided at ``level``.
        n_draws: normal vectors simulated for the simultaneous critical value.
        seed: seed of those draws.

    Returns:
        ``low``, ``high``, ``upper`` ``(T,)`` and the critical values ``c_low`` ``(T,)``, ``z_high``, ``z_upper``.
    """
    d = pair_matrix(est.shape[-1])
    delta = np.abs(est @ d.T)  # (T, L); the pair (j, k) and (k, j) give ±δ, the max keeps |δ|
    ccov = np.einsum("lk,tkm,nm->tln", d, cov, d)
    se = np.sqrt(np.clip(np.einsum("tll->tl", ccov), 0.0, None))
    q = (1.0 + level) / 2.0
    c_low = max_abs_t_quantiles(ccov, np.array([q]), n_draws, np.random.default_rng(seed))[:, 0]
    z_high, z_upper = normal_quantile(q), normal_quantile(level)
    return {
        "low": np.maximum(0.0, (delta - c_low[:, None] * se).max(axis=-1)),
        "high": (delta + z_high * se).max(axis=-1),
        "upper": (delta + z_upper * se).max(axis=-1),
        "c_low": c_low,
        "z_high": np.full(est.shape[0], z_high),
        "z_upper": np.full(est.shape[0], z_upper),
    }


def _interval(estimate: float, est: np.ndarray, cov: np.ndarray, level: float, n_draws: int, seed: int,
              scheme: str) -> GapInterval:
    if est.size < 2:  # one phase: the gap is 0 by definition
        return GapInterval("folded_gap", estimate, 0.0, 0.0, level, 0.0, scheme, 0.0, 0.0, n_draws)
    b = gap_bounds(est[None], cov[None], level=level, n_draws=n_draws, seed=seed)
    return GapInterval(
        name="folded_gap",
        estimate=estimate,
        ci_low=float(b["low"][0]),
        ci_high=float(b["high"][0]),
        level=level,
        upper_bound=float(b["upper"][0]),
        scheme=scheme,
        critical_low=float(b["c_low"][0]),
        critical_high=float(b["z_high"][0]),
        n_draws=n_draws,
    )


def gap_ci(
    correct: ArrayLike | int | float,
    n: ArrayLike | int | float,
    stride: int,
    *,
    level: float = 0.95,
    n_draws: int = 20000,
    seed: int = 0,
) -> GapInterval:
    """Confidence interval and equivalence bound for the folded max − min gap, from counts.

    Each trial is its own item (independent Bernoulli outcomes); residues are folded mod ``stride`` by summing
    counts. See the module docstring for the construction and docs/statistics.md for its coverage.

    Args:
        correct: ``(M,)`` correct answers per residue.
        n: an int or ``(M,)`` trials per residue.
        stride: S (divides M); with S = 1 the gap and its bounds are 0.
        level: two-sided level of ``(ci_low, ci_high)``; ``upper_bound`` is one-sided at ``level``.
        n_draws: simulated vectors for the lower bound's simultaneous critical value.
        seed: seed of those draws.

    Example:
        >>> r = gap_ci([112, 178, 169, 76, 115, 179, 165, 84], 256, 4)
        >>> round(r.estimate, 4), round(r.ci_low, 3), round(r.ci_high, 3), round(r.upper_bound, 3)
        (0.3848, 0.302, 0.44, 0.431)
    """
    c, t = check_counts(correct, n)
    if c.ndim != 1:
        raise StatsInputError(f"correct must be 1-D, one count per residue, got shape {c.shape}.")
    stride, _ = check_stride(stride, c.size)
    level = check_level(level)
    b = check_draws(n_draws, "n_draws")
    est, cov = count_moments(c, t, stride)
    return _interval(float(folded_gap_from_counts(c, t, stride)), est, cov, level, b, seed, "independent trials")


def item_gap_ci(
    item_ids: ArrayLike | int | float,
    residues: ArrayLike | int | float,
    values: ArrayLike | int | float,
    stride: int,
    modulus: int | None = None,
    *,
    level: float = 0.95,
    n_draws: int = 20000,
    seed: int = 0,
) -> GapInterval:
    """Confidence interval and equivalence bound for the folded gap of phase means, from per-item rows.

    Phase means pool every row of the phase; their covariance is the item-cluster sandwich, so an item seen at
    several phases (a paired design) makes phases correlated and the differences sharper. Works for every
    design: unpaired, paired, or partly crossed. 0/1 values get the Agresti–Caffo pseudo-observations.

    Args:
        item_ids: ``(N,)`` item label per row.
        residues: ``(N,)`` residue per row, in 0..M−1.
        values: ``(N,)`` outcome per row (0/1 or a continuous metric).
        stride: S (divides M); with S = 1 the gap and its bounds are 0.
        modulus: M; default ``max(residues) + 1`` rounded up to a multiple of S.
        level, n_draws, seed: as in :func:`gap_ci`.
    """
    r, stride, modulus = resolve_residues(residues, stride, modulus)
    v = check_values(values, "values", r.size)
    item = item_codes(item_ids, r.size)
    return item_interval(item, r, v, stride, np.arange(stride), level=check_level(level),
                         n_draws=check_draws(n_draws, "n_draws"), seed=seed)


def item_interval(item: np.ndarray, r: np.ndarray, v: np.ndarray, stride: int, phases: np.ndarray, *,
                  level: float, n_draws: int, seed: int) -> GapInterval:
    """:func:`item_gap_ci` on validated rows, over the given ``phases`` (all S, or those of a residue subset);
    each of them needs rows."""
    n_items = int(item.max()) + 1
    idx = item * stride + r % stride
    sums = np.bincount(idx, weights=v, minlength=n_items * stride).reshape(n_items, stride)[:, phases]
    counts = np.bincount(idx, minlength=n_items * stride).reshape(n_items, stride).astype(np.float64)[:, phases]
    rows = counts.sum(axis=0)
    if np.any(rows == 0):
        empty = np.asarray(phases)[rows == 0].tolist()
        raise StatsInputError(f"phases {empty} (mod {stride}) have no rows; every phase needs data for a gap.")
    binary = bool(np.all((v == 0) | (v == 1)))
    est, cov = item_moments(sums, counts, binary)
    crossed = bool(np.any((counts > 0).sum(axis=1) > 1))
    scheme = "item-cluster" if crossed else "items, one phase each"
    return _interval(float(gap(sums.sum(axis=0) / rows)), est, cov, level, n_draws, seed, scheme)


def batch_count_bounds(correct: np.ndarray, n: np.ndarray, stride: int, **kw: object) -> dict[str, np.ndarray]:
    """:func:`gap_bounds` for a batch ``(T, M)`` of count tables (simulations)."""
    est, cov = count_moments(np.asarray(correct), np.asarray(n), stride)
    return gap_bounds(est, cov, **kw)  # type: ignore[arg-type]


def batch_paired_bounds(matrix: np.ndarray, stride: int, **kw: object) -> dict[str, np.ndarray]:
    """:func:`gap_bounds` for a batch ``(T, items, M)`` of complete paired 0/1 matrices (simulations)."""
    x = np.asarray(matrix, dtype=np.float64)
    sums = fold(x, stride)
    counts = np.full_like(sums, x.shape[-1] // stride)
    est, cov = item_moments(sums, counts, binary=True)
    return gap_bounds(est, cov, **kw)  # type: ignore[arg-type]
