"""The one grouping primitive: per-group (residue or phase) means, intervals and bootstraps of per-item values.

Every analysis summarises items per residue and per phase through these functions, each a batched
reduction with a one-hot ``[N, G]`` matrix (no loop over groups, cells or heads). Groups are residues
(``0..M-1``) or phases (``residue % S``). The relative change of an intervention is :func:`rel_change`.
"""

from __future__ import annotations

import numpy as np
import scipy.stats as sps

EPS_CLEAN = 0.02  # clean accuracy below this: relative change is undefined (NaN, flagged)


def one_hot(groups: np.ndarray, n_groups: int) -> np.ndarray:
    """``[N, G]`` float indicator of each item's group."""
    g = np.asarray(groups)
    return (g[:, None] == np.arange(n_groups)[None, :]).astype(np.float64)


def group_counts(groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Items per group ``[G]``."""
    return np.bincount(np.asarray(groups, dtype=np.int64), minlength=n_groups)[:n_groups]


def residue_mean(values: np.ndarray, residue: np.ndarray, modulus: int) -> np.ndarray:
    """Mean over items per group, ignoring NaN.

    Args:
        values: ``[N, ...]`` one value (or array of values) per item.
        residue: ``[N]`` integer group of each item, in ``0..modulus-1``.
        modulus: the number of groups G.

    Returns:
        ``[..., G]``: NaN where a group has no finite value.

    Example:
        >>> residue_mean(np.array([1.0, 3.0, 5.0]), np.array([0, 0, 2]), 3).tolist()
        [2.0, nan, 5.0]
    """
    return residue_mean_ci(values, residue, modulus, ci=False)[0]


group_mean = residue_mean


def residue_mean_ci(
    values: np.ndarray, residue: np.ndarray, modulus: int, *, ci: bool = True, level: float = 0.95
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and Student-t confidence interval over items per group, ignoring NaN.

    Args:
        values: ``[N, ...]``.
        residue: ``[N]`` integers in ``0..modulus-1``.
        modulus: the number of groups G.
        ci: also compute the interval (otherwise ``lo`` and ``hi`` are NaN).
        level: two-sided confidence level.

    Returns:
        ``(mean, lo, hi)``, each ``[..., G]``. The interval is NaN where a group has fewer than two values.
    """
    v = np.asarray(values, dtype=np.float64)
    n_items, shape = v.shape[0], v.shape[1:]
    flat = v.reshape(n_items, -1)
    ok = ~np.isnan(flat)
    onehot = one_hot(residue, modulus).T  # [G, N]
    count = onehot @ ok  # [G, K]
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


group_mean_ci = residue_mean_ci


def bootstrap_counts(groups: np.ndarray, n_groups: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each item is drawn in each of ``n_boot`` resamples that keep every group's size:
    ``[n_boot, N]`` (items are resampled within their group, all groups and resamples in one draw)."""
    g = np.asarray(groups, dtype=np.int64)
    N = len(g)
    order = np.argsort(g, kind="stable")
    size = group_counts(g, n_groups)
    start = np.concatenate([[0], np.cumsum(size)[:-1]])
    gs = g[order]
    draw = start[gs][None, :] + (rng.random((n_boot, N)) * size[gs][None, :]).astype(np.int64)  # [B, N]
    counts = np.zeros((n_boot, N), np.float64)
    np.add.at(counts, (np.arange(n_boot)[:, None], order[draw]), 1.0)
    return counts


def bootstrap_group_means(values: np.ndarray, counts: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Group means of ``values`` ``[C, N]`` in each resample of ``counts`` ``[B, N]``: ``[C, B, G]``.

    One matmul per chunk of resamples; NaN where a group is empty.
    """
    v = np.atleast_2d(np.asarray(values, dtype=np.float64))
    onehot = one_hot(groups, n_groups)  # [N, G]
    size = group_counts(groups, n_groups).astype(np.float64)
    B = counts.shape[0]
    out = np.empty((v.shape[0], B, n_groups))
    step = max(1, 2**24 // max(1, counts.shape[1] * n_groups))  # bound the [b, N, G] temporary
    for b in range(0, B, step):  # chunks of resamples, not a loop over groups or cells
        w = counts[b : b + step, :, None] * onehot[None]  # [b, N, G]
        out[:, b : b + step] = np.einsum("cn,bng->cbg", v, w, optimize=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return out / np.where(size > 0, size, np.nan)


def rel_change(ko: np.ndarray, clean: np.ndarray, eps: float = EPS_CLEAN) -> np.ndarray:
    """The paper's relative accuracy change ``100 (KO - clean) / clean`` in percent; NaN where
    ``clean < eps`` (undefined: a change relative to almost nothing)."""
    ko, clean = np.asarray(ko, dtype=np.float64), np.asarray(clean, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(clean >= eps, 100 * (ko - clean) / clean, np.nan)
