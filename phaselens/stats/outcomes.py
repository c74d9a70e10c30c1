"""Small frozen result types shared by the statistics modules.

Each has ``.to_frame()`` (a one-row tidy :class:`pandas.DataFrame`) and a one-line ``repr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from phaselens.stats._checks import check_alpha


def fmt_p(p: float) -> str:
    """A p-value as people read it: 3 decimals, or scientific notation when tiny."""
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "nan"
    return f"{p:.3f}" if p >= 1e-3 else f"{p:.2e}"


@dataclass(frozen=True, repr=False)
class TestResult:
    """A classical test: statistic referred to a χ² distribution with ``df`` degrees of freedom.

    Attributes:
        name: what was tested (``"chi2"``, ``"g"``, ``"cochran_q"``, ``"cmh"``, ``"nested_fold_8_vs_4"``...).
        statistic: the test statistic.
        df: degrees of freedom (0 means nothing to test; then ``pvalue`` is 1).
        pvalue: upper-tail p-value.
    """

    __test__: ClassVar[bool] = False  # not a pytest test class, despite the name

    name: str
    statistic: float
    df: int
    pvalue: float

    def rejects(self, alpha: float = 0.05) -> bool:
        """True when ``pvalue < alpha`` (``alpha`` strictly between 0 and 1)."""
        return bool(self.pvalue < check_alpha(alpha))

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            [{"test": self.name, "statistic": self.statistic, "df": self.df, "pvalue": self.pvalue}]
        )

    def __repr__(self) -> str:
        return (
            f"TestResult({self.name}: statistic={self.statistic:.4g}, df={self.df}, p={fmt_p(self.pvalue)})"
        )


@dataclass(frozen=True, repr=False)
class PermutationResult:
    """A Monte Carlo permutation test of a statistic where large values are evidence against the null.

    Attributes:
        name: the statistic (e.g. ``"folded_gap"``).
        statistic: its observed value.
        pvalue: ``(1 + #{null >= observed}) / (n_permutations + 1)``, never 0.
        n_permutations: number of random permutations drawn.
        null_mean: mean of the statistic over the permutations: the size it has with no phase effect
            (the max−min gap is biased upward, so this is not 0).
        scheme: how outcomes were permuted (``"unpaired"``: pooled across residues with per-residue n fixed;
            ``"within-item"``: each item's outcomes across residues).
    """

    name: str
    statistic: float
    pvalue: float
    n_permutations: int
    null_mean: float
    scheme: str

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            [
                {
                    "test": f"{self.name} permutation ({self.scheme})",
                    "statistic": self.statistic,
                    "null_mean": self.null_mean,
                    "pvalue": self.pvalue,
                    "n_permutations": self.n_permutations,
                }
            ]
        )

    def __repr__(self) -> str:
        return (
            f"PermutationResult({self.name}, {self.scheme}: statistic={self.statistic:.4g}, "
            f"null mean={self.null_mean:.4g}, p={fmt_p(self.pvalue)}, B={self.n_permutations})"
        )


@dataclass(frozen=True, repr=False)
class GapInterval:
    """Confidence bounds for a max − min gap (see :mod:`phaselens.stats.gapci` for the construction).

    Attributes:
        name: the statistic (``"folded_gap"``).
        estimate: the gap on the data (unadjusted max − min of the phase accuracies or means).
        ci_low, ci_high: two-sided interval at ``level``; each side holds with probability ≥ (1 + level)/2.
        level: confidence level.
        upper_bound: one-sided upper bound at ``level``: the equivalence margin ("the gap is below this").
        scheme: ``"independent trials"`` (counts), ``"item-cluster"`` (items cross phases) or
            ``"items, one phase each"``.
        critical_low: simultaneous critical value used for ``ci_low`` (over all phase pairs).
        critical_high: normal quantile used for ``ci_high`` (one pair suffices for an upper bound).
        n_draws: simulated vectors behind ``critical_low``.
    """

    name: str
    estimate: float
    ci_low: float
    ci_high: float
    level: float
    upper_bound: float
    scheme: str
    critical_low: float
    critical_high: float
    n_draws: int

    method: ClassVar[str] = "pairwise differences: simultaneous lower bound, single-pair upper bound"

    def to_frame(self) -> pd.DataFrame:
        return _one_row(self, ("estimate", "ci_low", "ci_high", "level", "upper_bound", "scheme", "critical_low",
                               "critical_high"))

    def __repr__(self) -> str:
        return (
            f"GapInterval({self.name}, {self.scheme}: {self.estimate:.4g} "
            f"[{self.ci_low:.4g}, {self.ci_high:.4g}] at {self.level:.0%}, "
            f"one-sided upper {self.upper_bound:.4g})"
        )


def _one_row(result: Any, columns: tuple[str, ...]) -> pd.DataFrame:
    """One row: ``statistic`` (the result's ``name``), then ``columns`` read from the result."""
    return pd.DataFrame([{"statistic": result.name, **{c: getattr(result, c) for c in columns}}])
