"""Adjusting p-values for multiple comparisons (many phases, heads, layers or models tested at once)."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from phaselens.errors import StatsInputError


def _pvalues(pvalues: ArrayLike | int | float) -> np.ndarray:
    p = np.asarray(pvalues, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise StatsInputError(
            f"pvalues must be a non-empty 1-D array, got shape {p.shape}; flatten it first."
        )
    if not np.all(np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise StatsInputError("pvalues must lie in [0, 1] with no NaN; drop the tests that produced NaN.")
    return p


def holm(pvalues: ArrayLike | int | float) -> np.ndarray:
    """Holm's step-down adjustment (controls the family-wise error rate).

    Sorted ascending, p_(i) becomes max_{j <= i} min(1, (m − j + 1) p_(j)); results come back in input order.

    Args:
        pvalues: ``(m,)`` raw p-values.

    Returns:
        ``(m,)`` adjusted p-values, each >= its raw value, capped at 1, monotone in the raw order.

    Example:
        >>> holm([0.01, 0.04, 0.03, 0.005]).tolist()
        [0.03, 0.06, 0.06, 0.02]
    """
    p = _pvalues(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = stepped
    return out


def benjamini_hochberg(pvalues: ArrayLike | int | float) -> np.ndarray:
    """Benjamini–Hochberg adjustment (controls the false discovery rate), via
    ``scipy.stats.false_discovery_control(method="bh")``.

    Args:
        pvalues: ``(m,)`` raw p-values.

    Returns:
        ``(m,)`` adjusted p-values in input order.

    Example:
        >>> benjamini_hochberg([0.01, 0.04, 0.03, 0.005]).round(6).tolist()
        [0.02, 0.04, 0.04, 0.02]
    """
    return np.asarray(stats.false_discovery_control(_pvalues(pvalues), method="bh"), dtype=np.float64)
