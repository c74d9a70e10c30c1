"""The battery on a subset of the residues (``evaluate(model, residues=[0, 1, 2, 3])``).

A design may cover only some residues of the cycle 0..M−1. On the K residues present, folded onto the k
phases they fall in (r mod S):

* per-residue accuracy and Wilson intervals; per-phase counts pool the residues present (a phase with none
  is absent: NaN in ``(S,)`` arrays);
* the omnibus χ² and G across the K residues (K ≥ 2), and Cochran's Q across them for paired items;
* the folded gap across the k phases present (k ≥ 2): its permutation tests (outcomes permuted across the
  residues present, within items when paired) and its interval (the pairwise construction of
  :mod:`~phaselens.stats.gapci` over the phases present);
* the nested test, residues present against their phases, with Σ(k_p − 1) df over the phases that hold k_p
  residues: defined only when some phase holds two or more.

Undefined without the whole cycle: the harmonic fraction (a DFT over all M residues) and period detection
(it compares every divisor of M). Those results are ``None`` and ``skipped`` names the reason.
tests/stats/test_subset.py checks the size of the tests and the coverage of the interval by seeded simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from phaselens.errors import ResidueError
from phaselens.stats._checks import check_residues, check_stride, readonly
from phaselens.stats.folding import fold, fold_by, gap
from phaselens.stats.omnibus import chi2_test, cochran_q, g_statistic, g_test
from phaselens.stats.outcomes import TestResult

WHOLE_CYCLE = {
    "harmonic": "the harmonic fraction is a DFT over all M residues; it needs every residue of the cycle",
    "period": "period detection compares every divisor of M; it needs every residue of the cycle",
}


@dataclass(frozen=True, repr=False, eq=False)
class ResidueSubset:
    """Which residues a design covers and the phases they fold onto.

    Attributes:
        residues: ``(K,)`` sorted distinct residues in 0..M−1 (all of them for a complete design).
        stride, modulus: S and M.
    """

    residues: np.ndarray
    stride: int
    modulus: int

    def __post_init__(self) -> None:
        readonly(self.residues)

    @property
    def complete(self) -> bool:
        return self.residues.size == self.modulus

    @property
    def phase_of(self) -> np.ndarray:
        """``(K,)`` phase of each residue present."""
        return self.residues % self.stride

    @property
    def phases(self) -> np.ndarray:
        """``(k,)`` the phases present, increasing."""
        return np.unique(self.phase_of)

    @property
    def codes(self) -> np.ndarray:
        """``(K,)`` index of each residue's phase in :attr:`phases`."""
        return np.searchsorted(self.phases, self.phase_of)

    @property
    def residues_per_phase(self) -> np.ndarray:
        """``(k,)`` residues present in each phase present."""
        return np.bincount(self.codes, minlength=self.phases.size)

    def column(self, residues: np.ndarray) -> np.ndarray:
        """Column index (0..K−1) of each residue in ``residues`` (all must be present)."""
        return np.searchsorted(self.residues, residues)

    def fold(self, x: np.ndarray) -> np.ndarray:
        """``(..., K)`` → ``(..., k)``: sums over the residues of each phase present."""
        return fold(x, self.stride) if self.complete else fold_by(x, self.codes, self.phases.size)

    def fold_all(self, x: np.ndarray) -> np.ndarray:
        """``(..., K)`` → ``(..., S)``: sums per phase 0..S−1, zero for a phase with no residue present."""
        return fold(x, self.stride) if self.complete else fold_by(x, self.phase_of, self.stride)

    def describe(self) -> str:
        if self.complete:
            return f"all {self.modulus} residues"
        return (f"residues {self.residues.tolist()} of 0..{self.modulus - 1} "
                f"(phases {self.phases.tolist()} of 0..{self.stride - 1})")


def residue_subset(residues: ArrayLike | None, stride: int, modulus: int) -> ResidueSubset:
    """Validate the residues a design covers (``None``: all of 0..M−1)."""
    stride, modulus = check_stride(stride, modulus)
    if residues is None:
        return ResidueSubset(np.arange(modulus), stride, modulus)
    r = check_residues(residues, modulus)
    if np.unique(r).size != r.size:
        raise ResidueError(f"residues {r.tolist()} repeat a residue; list each residue once.")
    return ResidueSubset(np.sort(r), stride, modulus)


def _nested_g(c: np.ndarray, t: np.ndarray, sub: ResidueSubset) -> tuple[TestResult | None, str | None]:
    """G across the residues present minus G across their phases, df K − k."""
    df = sub.residues.size - sub.phases.size
    name = f"nested_fold_{sub.residues.size}_vs_{sub.phases.size}"
    if df == 0:
        return None, ("the nested test needs a phase with two or more residues present; here each phase "
                      "present holds one, so residues and phases coincide")
    stat = float(max(g_statistic(c, t) - g_statistic(sub.fold(c), sub.fold(t)), 0.0))
    return TestResult(name, stat, df, float(stats.chi2.sf(stat, df))), None


def count_tests(c: np.ndarray, t: np.ndarray, sub: ResidueSubset, *, n_permutations: int, seed: int,
                level: float, n_draws: int | None) -> dict[str, Any]:
    """The count battery's tests on a proper subset of residues (see the module docstring).

    Args:
        c, t: ``(K,)`` correct and trials at ``sub.residues``.
        n_draws: draws for the gap interval's critical value; ``None`` skips the interval.

    Returns:
        ``chi2``, ``g``, ``nested``, ``harmonic``, ``gap_test``, ``gap_ci``, ``period`` (each ``None`` where
        undefined) and ``skipped`` (name → reason).
    """
    from phaselens.stats.contrasts import count_moments
    from phaselens.stats.gapci import _interval
    from phaselens.stats.resampling import gap_permutation_test

    skipped: dict[str, str] = dict(WHOLE_CYCLE)
    out: dict[str, Any] = dict(chi2=None, g=None, nested=None, harmonic=None, gap_test=None, gap_ci=None,
                               period=None)
    if sub.residues.size < 2:
        skipped["omnibus"] = "one residue present: nothing to compare"
    else:
        out["chi2"], out["g"] = chi2_test(c, t), g_test(c, t)
    out["nested"], why = _nested_g(c, t, sub)
    if why:
        skipped["nested"] = why
    if sub.phases.size < 2:
        skipped["gap"] = "one phase present: the folded gap is 0 by definition"
        return {**out, "skipped": skipped}
    out["gap_test"] = gap_permutation_test(c, t, sub.stride, n_permutations=n_permutations, seed=seed,
                                           phases=sub.phase_of)
    if n_draws is not None:
        pc, pn = sub.fold(c), sub.fold(t)
        est, cov = count_moments(pc, pn, pc.size)  # already folded: one "residue" per phase present
        out["gap_ci"] = _interval(float(gap(pc / pn)), est, cov, level, n_draws, seed, "independent trials")
    return {**out, "skipped": skipped}


def paired_tests(m: np.ndarray, sub: ResidueSubset, *, n_permutations: int, seed: int) -> dict[str, Any]:
    """Paired tests on an ``(items, K)`` 0/1 matrix over a proper subset of residues: ``cochran``,
    ``within_item``, ``nested`` (each ``None`` where undefined) and ``skipped`` (name → reason)."""
    from phaselens.stats.paired import nested_cochran_q
    from phaselens.stats.resampling import within_item_permutation_test

    skipped: dict[str, str] = {"period": WHOLE_CYCLE["period"]}
    out: dict[str, Any] = dict(cochran=None, within_item=None, nested=None)
    if sub.residues.size < 2:
        skipped["cochran"] = "one residue present: nothing to compare"
    else:
        out["cochran"] = cochran_q(m)
    if sub.residues.size > sub.phases.size:
        out["nested"] = nested_cochran_q(m, sub.stride, phases=sub.phase_of)
    else:
        skipped["nested"] = ("the nested test needs a phase with two or more residues present; here each "
                             "phase present holds one")
    if sub.phases.size < 2:
        skipped["within_item"] = "one phase present: the folded gap is 0 by definition"
    else:
        out["within_item"] = within_item_permutation_test(m, sub.stride, n_permutations=n_permutations, seed=seed,
                                                          phases=sub.phase_of)
    return {**out, "skipped": skipped}

