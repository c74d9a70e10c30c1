"""The statistics battery's computation: :func:`phase_battery` checks per-residue counts (or published
accuracies) and :func:`count_battery` runs every test and interval on them into a
:class:`~phaselens.stats.battery.PhaseBattery`."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from phaselens.errors import ResidueError
from phaselens.stats._checks import check_alpha, check_draws, check_level, check_stride, resolve_residues
from phaselens.stats.battery import PhaseBattery
from phaselens.stats.gapci import MIN_DRAWS, gap_ci
from phaselens.stats.intervals import wilson_ci
from phaselens.stats.omnibus import chi2_test, g_test
from phaselens.stats.period import detect_period
from phaselens.stats.periodicity import harmonic_fraction, nested_fold_test
from phaselens.stats.published import counts_from_accuracy
from phaselens.stats.resampling import gap_permutation_test
from phaselens.stats.subset import ResidueSubset, count_tests, residue_subset


def phase_battery(
    correct: ArrayLike | int | float,
    n: ArrayLike | int | float,
    stride: int,
    modulus: int | None = None,
    *,
    residues: ArrayLike | None = None,
    alpha: float = 0.05,
    level: float = 0.95,
    n_permutations: int = 9999,
    n_bootstrap: int = 2000,
    seed: int = 0,
    scale: str = "auto",
) -> PhaseBattery:
    """Run the whole battery on per-residue counts (or published accuracies with n).

    Every random component uses ``np.random.default_rng(seed)`` afresh, so each p-value or interval equals the
    one its standalone function returns with the same seed.

    Args:
        correct: ``(M,)`` correct answers per residue (residue r = (t − origin) mod M), or accuracies: values
            with decimals are read as percentages (any above 1) or fractions and rounded to whole counts with
            ``n``; every printed value must be reproduced (:func:`~phaselens.stats.published.counts_from_accuracy`).
            With ``residues``, one entry per listed residue.
        n: an int, or ``(M,)`` trials per residue (``(K,)`` with ``residues``).
        stride: S; M must be a multiple of S.
        modulus: M; defaults to ``len(correct)`` and, when given, must equal it (with ``residues``: defaults
            to ``max(residues) + 1`` rounded up to a multiple of S).
        residues: the residues the counts belong to, when only some of 0..M−1 were tested. The tests then run
            on the residues present (:mod:`phaselens.stats.subset`); those that need the whole cycle are
            ``None`` and ``skipped`` says why.
        alpha: level for rejections and period detection.
        level: confidence level of the Wilson and bootstrap intervals.
        n_permutations: permutations for the gap and harmonic p-values.
        n_bootstrap: simulated vectors for the gap CI's lower bound (at least ``MIN_DRAWS`` = 20,000 are used);
            0 skips the CI.
        seed: seed of every random draw.
        scale: ``"auto"``, ``"counts"``, ``"percent"`` or ``"fraction"`` (how to read ``correct``).

    Example:
        >>> b = phase_battery([112, 178, 169, 76, 115, 179, 165, 84], 256, stride=4, n_permutations=999)
        >>> round(100 * b.residue_gap, 2), b.period.period, b.worst_phase
        (40.23, 4, 3)
        >>> round(100 * b.worst_residue_accuracy, 2), round(100 * b.best_residue_accuracy, 2)
        (29.69, 69.92)
        >>> sub = phase_battery([112, 178, 169, 76], 256, stride=4, modulus=8, residues=[0, 1, 2, 3],
        ...                     n_permutations=999)
        >>> sub.nested is None, sub.period is None, sorted(sub.skipped)
        (True, True, ['harmonic', 'nested', 'period'])
    """
    c, t, note = counts_from_accuracy(correct, n, scale)
    if c.ndim != 1:
        raise ResidueError(f"correct must be 1-D, one count per residue, got shape {c.shape}.")
    if residues is None:
        m = c.size if modulus is None else modulus
        stride, m = check_stride(stride, m)
        if m != c.size:
            raise ResidueError(
                f"modulus {m} but correct has {c.size} residues; pass one count per residue 0..{m - 1} "
                "(use fold_counts to fold a longer table first, or residues= for a subset)."
            )
        sub = residue_subset(None, stride, m)
    else:
        r = np.asarray(residues)
        if r.ndim != 1 or r.size != c.size:
            raise ResidueError(f"residues has {r.size} entries but correct has {c.size}; pass one residue per count.")
        if modulus is None:
            _, stride, modulus = resolve_residues(r, stride, None)
        sub = residue_subset(r, stride, modulus)
        order = np.argsort(r, kind="stable")
        c, t = c[order], t[order]
    alpha, level = check_alpha(alpha), check_level(level)
    b = check_draws(n_permutations, "n_permutations")
    boot = None if n_bootstrap == 0 else max(check_draws(n_bootstrap, "n_bootstrap"), MIN_DRAWS)
    return count_battery(c, t, sub, alpha=alpha, level=level, n_permutations=b, n_draws=boot, seed=seed,
                         input_note=note)


def count_battery(c: np.ndarray, t: np.ndarray, sub: ResidueSubset, *, alpha: float, level: float,
                  n_permutations: int, n_draws: int | None, seed: int, input_note: str | None = None) -> PhaseBattery:
    """:func:`phase_battery` on validated counts ``(K,)`` at ``sub.residues`` (``n_draws=None``: no gap CI)."""
    stride, b = sub.stride, n_permutations
    lo, hi = wilson_ci(c, t, level)
    pc, pn = sub.fold_all(c), sub.fold_all(t)
    tested = pn > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        pa = np.where(tested, pc / np.maximum(pn, 1), np.nan)
    plo, phi = np.full(stride, np.nan), np.full(stride, np.nan)
    plo[tested], phi[tested] = wilson_ci(pc[tested], pn[tested], level)
    acc = c / t
    if sub.complete:
        gap_test = gap_permutation_test(c, t, stride, n_permutations=b, seed=seed)
        tests: dict[str, Any] = dict(
            chi2=chi2_test(c, t), g=g_test(c, t), nested=nested_fold_test(c, t, stride),
            harmonic=harmonic_fraction(c, t, stride, n_permutations=b, seed=seed), gap_test=gap_test,
            gap_ci=None if n_draws is None else gap_ci(c, t, stride, level=level, n_draws=n_draws, seed=seed),
            period=detect_period(c, t, alpha=alpha), skipped={},
        )
    else:
        tests = count_tests(c, t, sub, n_permutations=b, seed=seed, level=level, n_draws=n_draws)
    return PhaseBattery(
        stride=stride,
        modulus=sub.modulus,
        alpha=alpha,
        level=level,
        correct=c,
        n=t,
        accuracy=acc,
        ci_low=lo,
        ci_high=hi,
        phase_correct=pc,
        phase_n=pn,
        phase_accuracy=pa,
        phase_ci_low=plo,
        phase_ci_high=phi,
        mean_accuracy=float(c.sum() / t.sum()),
        worst_phase=int(np.nanargmin(pa)),
        worst_accuracy=float(np.nanmin(pa)),
        best_phase=int(np.nanargmax(pa)),
        best_accuracy=float(np.nanmax(pa)),
        boundary_accuracy=float(pa[-1]),
        residue_gap=float(np.ptp(acc)),
        phase_gap=float(np.nanmax(pa) - np.nanmin(pa)),
        worst_residue=int(sub.residues[np.argmin(acc)]),
        worst_residue_accuracy=float(acc.min()),
        best_residue=int(sub.residues[np.argmax(acc)]),
        best_residue_accuracy=float(acc.max()),
        input_note=input_note,
        residues=np.array(sub.residues),
        **tests,
    )
