"""Per-residue effects of interventions: relative accuracy change with bootstrap CIs and exact McNemar p.

Shared by ``ablate`` (one knockout) and ``specialization_map`` (many cells), so both report the same
numbers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

EPS_CLEAN = 0.02  # clean accuracy below this: relative change is undefined (NaN, flagged)


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
    b = (clean & ~ko).sum(axis)
    c = (~clean & ko).sum(axis)
    m = b + c
    p = np.minimum(1.0, 2 * sps.binom.cdf(np.minimum(b, c), np.maximum(m, 1), 0.5))
    return np.where(m == 0, 1.0, p)


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
    """Effects of ``C`` interventions on ``N`` paired items.

    Args:
        clean_correct: ``[N]`` bool; ko_correct: ``[C, N]`` bool; groups: ``[N]`` residue of each item.
        clean_ld, ko_ld: optional logit differences ``[N]`` and ``[C, N]``.
        n_bootstrap: resamples of items within each group for the CI of the relative change.
    """
    clean_correct = np.asarray(clean_correct, bool)
    ko_correct = np.atleast_2d(np.asarray(ko_correct, bool))
    C = ko_correct.shape[0]
    shape = (C, n_groups)
    clean_acc = np.full(n_groups, np.nan)
    ko_acc, rel, lo, hi, pval, dld = (np.full(shape, np.nan) for _ in range(6))
    n = np.zeros(n_groups, int)
    rng = np.random.default_rng(seed)
    alpha = (1 - level) / 2
    for g in range(n_groups):
        idx = np.flatnonzero(groups == g)
        n[g] = len(idx)
        if not len(idx):
            continue
        cc, kc = clean_correct[idx], ko_correct[:, idx]
        clean_acc[g] = cc.mean()
        ko_acc[:, g] = kc.mean(1)
        pval[:, g] = mcnemar_p(cc[None, :], kc)
        if clean_ld is not None and ko_ld is not None:
            dld[:, g] = (np.asarray(ko_ld)[:, idx] - np.asarray(clean_ld)[idx]).mean(1)
        if clean_acc[g] < eps:
            continue
        rel[:, g] = 100 * (ko_acc[:, g] - clean_acc[g]) / clean_acc[g]
        if n_bootstrap:
            # Resample items (the same draw for clean and KO keeps the pairing).
            draw = rng.integers(0, len(idx), (n_bootstrap, len(idx)))
            c_b = cc[draw].mean(1)  # [B]
            k_b = kc[:, draw].mean(2)  # [C, B]
            # a resample with no clean hit has no relative change: drop it rather than carry inf
            with np.errstate(divide="ignore", invalid="ignore"):
                r_b = np.where(c_b > 0, 100 * (k_b - c_b) / c_b, np.nan)
            lo[:, g], hi[:, g] = np.nanquantile(r_b, [alpha, 1 - alpha], axis=1)
    undefined = ~(clean_acc >= eps)
    return Effects(clean_acc, ko_acc, rel, lo, hi, pval, dld, np.broadcast_to(undefined, shape).copy(), n)
