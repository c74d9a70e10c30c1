"""Seeded table generators for simulation studies (coverage, size, power), batched over tables.

* :func:`count_tables`: independent trials, ``(T, M)`` binomial counts for a per-residue accuracy profile.
* :func:`paired_tables`: every item at every residue, item difficulty varying: ``(T, items, M)`` 0/1
  outcomes with P(correct) = expit(β_r + σ·b_i), b_i ~ N(0, 1). The β_r are solved so that the *marginal*
  accuracy of residue r equals the profile, so the true gap is the profile's gap whatever σ.

Used by the coverage and size tests and by ``python -m experiments.stats_simulations`` (docs/statistics.md's tables).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special

from phaselens.errors import StatsInputError

_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(80)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()


def marginal_accuracy(logit: float, item_sd: float) -> float:
    """E[expit(logit + item_sd · b)] for b ~ N(0, 1) (Gauss–Hermite quadrature)."""
    return float((special.expit(logit + item_sd * _NODES) * _WEIGHTS).sum())


def logits_for(profile: ArrayLike, item_sd: float) -> np.ndarray:
    """Per-residue logits β whose marginal accuracies equal ``profile`` (each strictly inside (0, 1))."""
    p = np.asarray(profile, dtype=np.float64)
    if np.any((p <= 0) | (p >= 1)):
        raise StatsInputError("profile accuracies must lie strictly between 0 and 1.")
    if item_sd == 0:
        return special.logit(p)
    return np.array([optimize.brentq(lambda b, q=q: marginal_accuracy(b, item_sd) - q, -40, 40) for q in p])


def count_tables(profile: ArrayLike, n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``(size, M)`` binomial counts, ``n`` independent trials per residue at accuracy ``profile``."""
    return rng.binomial(n, np.asarray(profile, dtype=np.float64), size=(size, len(profile)))


def paired_tables(
    profile: ArrayLike, items: int, item_sd: float, size: int, rng: np.random.Generator
) -> np.ndarray:
    """``(size, items, M)`` 0/1 outcomes of ``items`` items answered at every residue.

    Args:
        profile: ``(M,)`` marginal accuracy per residue.
        items: items per table.
        item_sd: SD of the item effect on the logit scale (1.5 in docs/statistics.md).
        size: tables.
        rng: generator.
    """
    beta = logits_for(profile, item_sd)
    b = rng.standard_normal((size, items, 1)) * item_sd
    return (rng.random((size, items, beta.size)) < special.expit(beta + b)).astype(np.int8)
