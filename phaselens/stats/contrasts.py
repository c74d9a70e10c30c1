"""Phase estimates with their covariance, and simultaneous normal bounds on linear contrasts of them.

Every interval in :mod:`phaselens.stats.gapci` and every equivalence check of the period detector reduces to
one question: given estimates ``est`` ``(K,)`` with covariance ``V`` ``(K, K)`` and contrasts ``D @ est``,
how far can all contrasts be off at once? The answer is the quantile of ``max_l |Z_l| / se_l`` with
``Z ~ N(0, D V Dᵀ)``, found by seeded simulation (one batched draw shared by all tables).

Two ways to get ``(est, V)``:

* :func:`count_moments`: independent trials per residue, folded mod ``period``. Agresti–Caffo adjusted
  proportions ``(c + 1) / (n + 2)`` with variance ``p(1 − p) / (n + 2)`` keep the variance away from 0 when a
  phase is all right or all wrong.
* :func:`item_moments`: per-item sums and counts; ratio means with the item-cluster sandwich covariance, so
  an item seen at several phases (a paired design) carries its correlation into ``V``. For 0/1 outcomes one
  pseudo-success and one pseudo-failure per phase play the Agresti–Caffo role.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

_CHUNK_ELEMENTS = 1 << 23  # cap on floats per batched simulation step (64 MB)


def count_moments(correct: np.ndarray, n: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray]:
    """Adjusted phase proportions and their (diagonal) covariance from validated counts.

    Args:
        correct, n: ``(..., M)`` whole counts per residue (already validated).
        period: P dividing M; residues are folded mod P by summing counts.

    Returns:
        ``(est, cov)``: ``(..., P)`` adjusted proportions and ``(..., P, P)`` covariance.
    """
    m = correct.shape[-1]
    c = correct.reshape(*correct.shape[:-1], m // period, period).sum(axis=-2).astype(np.float64)
    t = n.reshape(*n.shape[:-1], m // period, period).sum(axis=-2).astype(np.float64)
    est = (c + 1.0) / (t + 2.0)
    var = est * (1.0 - est) / (t + 2.0)
    return est, var[..., :, None] * np.eye(period)


def item_moments(sums: np.ndarray, counts: np.ndarray, binary: bool) -> tuple[np.ndarray, np.ndarray]:
    """Ratio means per phase and their item-cluster sandwich covariance.

    Args:
        sums, counts: ``(..., items, K)`` per-item totals and row counts at each of K phases (or residues).
        binary: outcomes are 0/1; add one pseudo-item with a success and one with a failure at every phase.

    Returns:
        ``(est, cov)``: ``(..., K)`` and ``(..., K, K)``. An item with no rows anywhere contributes nothing.
    """
    s = np.asarray(sums, dtype=np.float64)
    c = np.asarray(counts, dtype=np.float64)
    k = s.shape[-1]
    if binary:  # pseudo-items: one success and one failure at each phase, each alone on its item
        eye = np.broadcast_to(np.eye(k), (*s.shape[:-2], k, k))
        s = np.concatenate([s, eye, np.zeros_like(eye)], axis=-2)
        c = np.concatenate([c, eye, eye], axis=-2)
    total = c.sum(axis=-2)  # (..., K)
    est = s.sum(axis=-2) / total
    u = (s - est[..., None, :] * c) / total[..., None, :]  # influence of each item on each phase mean
    n_items = np.count_nonzero(c.sum(axis=-1) > 0, axis=-1)[..., None, None]
    cov = np.einsum("...ik,...il->...kl", u, u) * n_items / np.maximum(n_items - 1, 1)
    return est, cov


def pair_matrix(k: int) -> np.ndarray:
    """``(K(K−1)/2, K)`` contrast matrix of all differences ``est_j − est_k`` with ``j < k``."""
    j, i = np.triu_indices(k, 1)
    d = np.zeros((j.size, k))
    d[np.arange(j.size), j] = 1.0
    d[np.arange(j.size), i] = -1.0
    return d


def _sqrt_psd(cov: np.ndarray) -> np.ndarray:
    """A matrix root ``R`` with ``R Rᵀ = cov`` for a batch of symmetric PSD matrices (negative roundoff clipped)."""
    w, q = np.linalg.eigh(cov)
    return q * np.sqrt(np.clip(w, 0.0, None))[..., None, :]


def max_abs_t_quantiles(
    contrast_cov: np.ndarray, probs: np.ndarray, n_draws: int, rng: np.random.Generator
) -> np.ndarray:
    """Quantiles of ``max_l |Z_l| / se_l`` with ``Z ~ N(0, contrast_cov)``, for a batch of covariances.

    Contrasts with zero variance are left out (they are known exactly). One set of standard normal draws is
    shared by the whole batch.

    Args:
        contrast_cov: ``(T, L, L)`` covariance of the contrasts.
        probs: ``(Q,)`` probabilities.
        n_draws: simulated vectors.
        rng: generator for the draws.

    Returns:
        ``(T, Q)`` quantiles (0 for a table whose contrasts all have zero variance).
    """
    t, ell, _ = contrast_cov.shape
    se = np.sqrt(np.clip(np.einsum("tll->tl", contrast_cov), 0.0, None))
    live = se > 1e-12 * np.maximum(se.max(axis=-1, keepdims=True), 1e-300)
    root = _sqrt_psd(contrast_cov)  # (T, L, L)
    inv_se = np.where(live, 1.0 / np.where(live, se, 1.0), 0.0)
    draws = rng.standard_normal((n_draws, ell))
    out = np.empty((t, len(probs)))
    chunk = max(1, _CHUNK_ELEMENTS // max(1, n_draws * ell))
    for a in range(0, t, chunk):
        z = np.einsum("bm,tlm->tbl", draws, root[a : a + chunk])  # (chunk, B, L)
        stat = np.abs(z * inv_se[a : a + chunk, None, :]).max(axis=-1)
        out[a : a + chunk] = np.quantile(stat, probs, axis=-1).T
    return out


def normal_quantile(prob: float) -> float:
    """Standard normal quantile (``scipy.stats.norm.ppf``)."""
    return float(stats.norm.ppf(prob))
