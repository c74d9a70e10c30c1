"""Per-residue effects of interventions: relative accuracy change with bootstrap CIs and exact McNemar p.

Shared by ``ablate`` (one knockout) and ``specialization_map`` (many cells), so both report the same
numbers the same way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from phaselens.stats.by_residue import (
    EPS_CLEAN,
    bootstrap_counts,
    bootstrap_group_means,
    group_counts,
    one_hot,
    rel_change,
    residue_mean,
)

# the columns of an effects frame (one row per group), in order
EFFECT_COLUMNS = ("n", "clean_acc", "ko_acc", "rel_change", "ci_low", "ci_high", "pvalue", "delta_logit_diff",
                  "undefined")


@dataclass(frozen=True)
class Effects:
    """Arrays ``[cells, groups]`` (groups = residues).

    ``clean_acc`` is ``[groups]``; ``rel_change`` = 100 (KO - clean) / clean in percent, NaN where
    ``undefined`` (clean accuracy < ``eps``); ``pvalue`` is the exact two-sided McNemar test of KO against
    clean on the paired items; ``delta_logit_diff`` is the mean change of the logit difference.
    """

    clean_acc: np.ndarray
    ko_acc: np.ndarray
    rel_change: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    pvalue: np.ndarray
    delta_logit_diff: np.ndarray
    undefined: np.ndarray
    n: np.ndarray


def mcnemar_p(clean: np.ndarray, ko: np.ndarray, axis: int = -1) -> np.ndarray:
    """Exact two-sided McNemar p-value along ``axis`` for paired 0/1 outcomes."""
    return _mcnemar_from_counts((clean & ~ko).sum(axis), (~clean & ko).sum(axis))


def relative_effects(
    clean_correct: np.ndarray,
    ko_correct: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    *,
    clean_ld: np.ndarray | None = None,
    ko_ld: np.ndarray | None = None,
    eps: float = EPS_CLEAN,
    n_bootstrap: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Effects:
    """Effects of ``C`` interventions on ``N`` paired items, per group (residue or phase).

    Args:
        clean_correct: ``[N]`` bool; ko_correct: ``[C, N]`` bool; groups: ``[N]`` group of each item.
        clean_ld, ko_ld: optional logit differences ``[N]`` and ``[C, N]``.
        n_bootstrap: resamples of items within each group for the percentile CI of the relative change
            (the same draw for clean and KO keeps the pairing; resamples with no clean hit are dropped).
    """
    clean_correct = np.asarray(clean_correct, bool)
    ko_correct = np.atleast_2d(np.asarray(ko_correct, bool))
    groups = np.asarray(groups, dtype=np.int64)
    C = ko_correct.shape[0]
    shape = (C, n_groups)
    onehot = one_hot(groups, n_groups)  # [N, G]
    n = group_counts(groups, n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        size = np.where(n > 0, n, np.nan)
        clean_acc = (clean_correct @ onehot) / size  # [G]
        ko_acc = (ko_correct @ onehot) / size  # [C, G]
    rel = rel_change(ko_acc, clean_acc[None], eps)
    # exact McNemar per cell and group: discordant pairs counted with the same one-hot
    b = ((clean_correct[None] & ~ko_correct) @ onehot).astype(np.int64)
    c = ((~clean_correct[None] & ko_correct) @ onehot).astype(np.int64)
    pval = _mcnemar_from_counts(b, c)
    pval = np.where(n[None] > 0, pval, np.nan)
    dld = np.full(shape, np.nan)
    if clean_ld is not None and ko_ld is not None:
        dld = residue_mean(np.atleast_2d(np.asarray(ko_ld)).T - np.asarray(clean_ld)[:, None], groups, n_groups)
    lo = np.full(shape, np.nan)
    hi = np.full(shape, np.nan)
    if n_bootstrap:
        counts = bootstrap_counts(groups, n_groups, int(n_bootstrap), np.random.default_rng(seed))
        c_b = bootstrap_group_means(clean_correct[None], counts, groups, n_groups)[0]  # [B, G]
        k_b = bootstrap_group_means(ko_correct, counts, groups, n_groups)  # [C, B, G]
        with np.errstate(divide="ignore", invalid="ignore"):
            r_b = np.where(c_b[None] > 0, 100 * (k_b - c_b[None]) / c_b[None], np.nan)
        alpha = (1 - level) / 2
        defined = ~np.isnan(rel)
        with warnings.catch_warnings():  # an all-NaN group (no clean hit in any resample) is expected
            warnings.simplefilter("ignore", RuntimeWarning)
            q = np.nanquantile(r_b, [alpha, 1 - alpha], axis=1)  # [2, C, G]
        lo, hi = np.where(defined, q[0], np.nan), np.where(defined, q[1], np.nan)
    undefined = ~(clean_acc >= eps)
    return Effects(clean_acc, ko_acc, rel, lo, hi, pval, dld, np.broadcast_to(undefined, shape).copy(), n)


def _mcnemar_from_counts(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    m = b + c
    p = np.minimum(1.0, 2 * sps.binom.cdf(np.minimum(b, c), np.maximum(m, 1), 0.5))
    return np.where(m == 0, 1.0, p)
