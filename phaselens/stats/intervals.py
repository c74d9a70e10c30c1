"""Wilson score intervals for per-residue and per-phase accuracy."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_counts, check_level


def wilson_ci(correct: ArrayLike | int | float, n: ArrayLike | int | float, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for a binomial proportion, vectorised.

    The same interval as ``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`` (no continuity
    correction), computed in closed form because ``binomtest`` takes one count at a time.

    Args:
        correct: ``(...)`` correct answers (scalar or array).
        n: ``(...)`` trials, broadcastable against ``correct``.
        level: confidence level.

    Returns:
        ``(lo, hi)``, each of the broadcast shape of the inputs (NumPy scalars for scalar inputs), in [0, 1].

    Example:
        >>> lo, hi = wilson_ci(112, 256)
        >>> round(100 * float(lo), 2), round(100 * float(hi), 2)
        (37.81, 49.87)
    """
    level = check_level(level)
    scalar = np.ndim(correct) == 0 and np.ndim(n) == 0
    try:
        k, t = np.broadcast_arrays(np.asarray(correct), np.asarray(n))
    except ValueError:
        raise StatsInputError(
            f"correct has shape {np.shape(correct)} and n has shape {np.shape(n)}, which do not broadcast; "
            "give n one entry per count or a single int."
        ) from None
    k, t = check_counts(np.atleast_1d(k), np.atleast_1d(t))
    z = stats.norm.isf((1.0 - level) / 2.0)
    p = k / t
    z2n = z * z / t
    center = (p + z2n / 2.0) / (1.0 + z2n)
    half = z / (1.0 + z2n) * np.sqrt(p * (1.0 - p) / t + z2n / (4.0 * t))
    # The exact bounds at k = 0 and k = n are 0 and 1; rounding would leave them a hair off.
    lo = np.where(k == 0, 0.0, np.clip(center - half, 0.0, 1.0))
    hi = np.where(k == t, 1.0, np.clip(center + half, 0.0, 1.0))
    if scalar:
        return lo[0], hi[0]
    return lo, hi
