"""Per-residue means of per-item values, in one batched reduction (no loop over residues or cells)."""

from __future__ import annotations

import numpy as np
import scipy.stats as sps


def _one_hot(residue: np.ndarray, modulus: int) -> np.ndarray:
    """``[M, N]`` float indicator of each item's residue."""
    return (np.arange(modulus)[:, None] == np.asarray(residue)[None, :]).astype(np.float64)


def residue_mean(values: np.ndarray, residue: np.ndarray, modulus: int) -> np.ndarray:
    """Mean over items per residue, ignoring NaN.

    Args:
        values: ``[N, ...]`` one value (or array of values) per item.
        residue: ``[N]`` integer residue of each item, in ``0..modulus-1``.
        modulus: M.

    Returns:
        ``[..., M]``: NaN where a residue has no finite value.

    Example:
        >>> residue_mean(np.array([1.0, 3.0, 5.0]), np.array([0, 0, 2]), 3).tolist()
        [2.0, nan, 5.0]
    """
    return residue_mean_ci(values, residue, modulus, ci=False)[0]


def residue_mean_ci(
    values: np.ndarray, residue: np.ndarray, modulus: int, *, ci: bool = True, level: float = 0.95
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and Student-t confidence interval over items per residue, ignoring NaN.

    Args:
        values: ``[N, ...]``.
        residue: ``[N]`` integers in ``0..modulus-1``.
        modulus: M.
        ci: also compute the interval (otherwise ``lo`` and ``hi`` are NaN).
        level: two-sided confidence level.

    Returns:
        ``(mean, lo, hi)``, each ``[..., M]``. The interval is NaN where a residue has fewer than two values.
    """
    v = np.asarray(values, dtype=np.float64)
    n_items, shape = v.shape[0], v.shape[1:]
    flat = v.reshape(n_items, -1)
    ok = ~np.isnan(flat)
    onehot = _one_hot(residue, modulus)  # [M, N]
    count = onehot @ ok  # [M, K]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, (onehot @ np.where(ok, flat, 0.0)) / count, np.nan)
        lo = hi = np.full_like(mean, np.nan)
        if ci:
            dev = np.where(ok, flat - mean[np.asarray(residue)], 0.0)
            var = (onehot @ dev**2) / (count - 1)
            dof = np.maximum(count - 1, 1)
            half = sps.t.ppf(0.5 + level / 2, dof) * np.sqrt(var / count)
            half = np.where(count > 1, half, np.nan)
            lo, hi = mean - half, mean + half

    def out(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a.reshape((modulus,) + shape), 0, -1)

    return out(mean), out(lo), out(hi)
