"""How concentrated a knockout's damage is over the phases, without the small-sample bias.

The damage of a knockout at phase p is its relative accuracy loss there, ``d_p = max(0, (clean_p - ko_p) /
clean_p)``. The raw concentration ``I = 1 - H(d / sum d) / log S`` is 0 when every phase is hurt alike and 1
when one phase takes all the damage. Like the max - min gap, it is biased upward by noise: a head with no
specialization at all gets a large ``I`` at small n, falling as n grows.

The **specialization** reported here removes that bias with a permutation null: the phase labels of the items
are permuted (keeping each item's clean and knocked-out outcomes together), which gives the concentration that
noise alone produces at this n, ``E[I_null]``; then ``SI = (I - E[I_null]) / (1 - E[I_null])``. ``SI`` is
about 0 for a head whose damage does not depend on the phase, whatever n, and about 1 for a head that hurts
one phase only. Its 95% interval is a percentile bootstrap (items resampled within phases, the null held
fixed) and ``p_perm`` is the permutation p-value of ``I``.

Rankings weigh magnitude: ``score = SI x (damage at the worst phase)``, so a head whose damage is negligible
never heads a list however concentrated its noise looks.

A knockout that damages no phase at all has no specialization: its SI, interval and raw index are NaN (not
0, and not the negative value ``(0 - E[I_null]) / (1 - E[I_null])`` would give, which reads as
"anti-specialized"), ``worst_phase`` is -1 and its score 0.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from phaselens.stats.by_residue import EPS_CLEAN, bootstrap_counts, bootstrap_group_means, one_hot


def concentration(damage: np.ndarray) -> np.ndarray:
    """``1 - H(q) / log S`` of damage ``[..., S]`` normalised over phases; 0 where there is no damage."""
    S = damage.shape[-1]
    total = damage.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(total > 0, damage / total, 0.0)
        ent = -np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0).sum(-1)
    return np.where(total[..., 0] > 0, 1 - ent / np.log(S), 0.0) if S > 1 else np.zeros(damage.shape[:-1])


def relative_damage(clean_acc: np.ndarray, ko_acc: np.ndarray, eps: float = EPS_CLEAN) -> np.ndarray:
    """``max(0, (clean - ko) / clean)`` per phase (0 where clean accuracy is below ``eps``)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(clean_acc >= eps, (clean_acc - ko_acc) / clean_acc, 0.0)
    return np.clip(np.nan_to_num(d), 0.0, None)


@dataclass(frozen=True)
class Specialization:
    """Arrays ``[cells]``: ``specialization`` (SI) with ``ci_low`` / ``ci_high``, the ``raw`` index, the
    ``null_mean`` it is corrected by, ``p_perm``, ``worst_phase``, ``worst_damage`` (relative, 0..1),
    ``mean_damage`` (over phases) and the ranking ``score``. A cell with no damage at any phase has NaN
    ``specialization``, interval and ``raw`` (undefined), ``worst_phase`` -1 and ``score`` 0."""

    specialization: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    raw: np.ndarray
    null_mean: np.ndarray
    p_perm: np.ndarray
    worst_phase: np.ndarray
    worst_damage: np.ndarray
    mean_damage: np.ndarray
    score: np.ndarray


def specialization(
    clean_correct: np.ndarray,
    ko_correct: np.ndarray,
    phase: np.ndarray,
    stride: int,
    *,
    n_permutations: int = 200,
    n_bootstrap: int = 200,
    seed: int = 0,
    level: float = 0.95,
    eps: float = EPS_CLEAN,
) -> Specialization:
    """Bias-corrected specialization of ``C`` knockouts over ``N`` paired items.

    Args:
        clean_correct: ``[N]`` bool; ko_correct: ``[C, N]`` bool; phase: ``[N]`` in ``0..S-1``.
        n_permutations: permutations of the phase labels for the null (and ``p_perm``).
        n_bootstrap: within-phase resamples for the interval (0: no interval).
    """
    clean = np.asarray(clean_correct, np.float64)
    ko = np.atleast_2d(np.asarray(ko_correct, np.float64))
    phase = np.asarray(phase, np.int64)
    S, N = int(stride), len(phase)
    rng = np.random.default_rng(seed)
    onehot = one_hot(phase, S)  # [N, S]
    n = onehot.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        c_acc, k_acc = clean @ onehot / n, ko @ onehot / n  # [S], [C, S]
    dmg = relative_damage(c_acc[None], k_acc, eps)  # [C, S]
    raw = concentration(dmg)
    # the null: phase labels permuted over items, all permutations in one batched product
    perms = np.argsort(rng.random((n_permutations, N)), axis=1)
    oh_p = onehot[perms]  # [P, N, S]
    with np.errstate(invalid="ignore", divide="ignore"):
        c_p = np.einsum("n,pns->ps", clean, oh_p) / n
        k_p = np.einsum("cn,pns->cps", ko, oh_p) / n
    null = concentration(relative_damage(c_p[None], k_p, eps))  # [C, P]
    null_mean = null.mean(1)
    p_perm = (1 + (null >= raw[:, None] - 1e-12).sum(1)) / (n_permutations + 1)
    room = 1 - null_mean  # when noise alone always concentrates the damage (e.g. one lost item): no evidence, SI 0
    with np.errstate(invalid="ignore", divide="ignore"):
        si = np.where(room > 1e-12, (raw - null_mean) / room, 0.0)
    lo = hi = np.full_like(si, np.nan)
    if n_bootstrap:
        counts = bootstrap_counts(phase, S, n_bootstrap, rng)
        c_b = bootstrap_group_means(clean[None], counts, phase, S)[0]  # [B, S]
        k_b = bootstrap_group_means(ko, counts, phase, S)  # [C, B, S]
        with np.errstate(invalid="ignore", divide="ignore"):
            si_b = np.where(room[:, None] > 1e-12, (concentration(relative_damage(c_b[None], k_b, eps))
                                                    - null_mean[:, None]) / room[:, None], 0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, hi = np.nanquantile(si_b, [(1 - level) / 2, (1 + level) / 2], axis=1)
    worst = dmg.max(1)
    none = worst <= 0  # no phase damaged: how concentrated nothing is has no answer (not 0, not negative)
    si, raw = np.where(none, np.nan, si), np.where(none, np.nan, raw)
    lo, hi = np.where(none, np.nan, lo), np.where(none, np.nan, hi)
    return Specialization(si, lo, hi, raw, null_mean, p_perm, np.where(worst > 0, dmg.argmax(1), -1), worst,
                          dmg.mean(1), np.where(none, 0.0, np.clip(si, 0, None) * worst))
