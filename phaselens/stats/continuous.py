"""Phase tests for continuous per-item metrics (per-token NLL, logit difference, ...).

Near ceiling accuracy the phase gap shrinks while the loss still differs by phase, so continuous metrics are
tested too:

* Kruskal–Wallis across the S phases (rank-based; rows are independent observations);
* Friedman across phases when items are paired (each item's values averaged within a phase first), or the
  Wilcoxon signed-rank test when S = 2. In a paired design this replaces Kruskal–Wallis as the decision
  (``omnibus``): Kruskal–Wallis ignores that an item's values are correlated across phases;
* a permutation test of the max−min of phase means: within items when paired, otherwise rows are permuted
  across phases (``scipy.stats.permutation_test``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy import stats

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_draws, check_values, item_codes, readonly, resolve_residues
from phaselens.stats.item_data import paired_matrix, pairing
from phaselens.stats.outcomes import PermutationResult, TestResult, fmt_p
from phaselens.stats.resampling import within_item_permutation_test
from phaselens.stats.subset import residue_subset


@dataclass(frozen=True, repr=False, eq=False)
class ContinuousResult:
    """Phase tests of one continuous metric.

    Attributes:
        metric: the metric's name.
        phase_means: ``(S,)`` mean per phase (all rows of the phase pooled).
        phase_n: ``(S,)`` rows per phase.
        kruskal: Kruskal–Wallis across phases.
        friedman: Friedman across phases for paired items (S ≥ 3), else ``None``.
        friedman_skipped: why Friedman was not run (``None`` when it was).
        permutation: permutation test of ``max(phase_means) − min(phase_means)``.
        wilcoxon: Wilcoxon signed-rank test of the two phases for paired items when S = 2, else ``None``.
    """

    metric: str
    phase_means: np.ndarray
    phase_n: np.ndarray
    kruskal: TestResult
    friedman: TestResult | None
    friedman_skipped: str | None
    permutation: PermutationResult
    wilcoxon: TestResult | None = None

    def __post_init__(self) -> None:
        readonly(self.phase_means, self.phase_n)

    @property
    def paired(self) -> bool:
        """Whether the items were paired (a paired test was run)."""
        return self.friedman is not None or self.wilcoxon is not None

    @property
    def omnibus(self) -> TestResult:
        """The test that decides: Friedman (or Wilcoxon for S = 2) when paired, else Kruskal–Wallis."""
        return self.friedman or self.wilcoxon or self.kruskal

    def to_frame(self) -> pd.DataFrame:
        rows = [("kruskal", self.kruskal.statistic, self.kruskal.df, self.kruskal.pvalue, None)]
        if self.friedman is not None:
            rows.append(("friedman", self.friedman.statistic, self.friedman.df, self.friedman.pvalue, None))
        else:
            rows.append(("friedman", np.nan, np.nan, np.nan, self.friedman_skipped))
        if self.wilcoxon is not None:
            rows.append(("wilcoxon", self.wilcoxon.statistic, np.nan, self.wilcoxon.pvalue, None))
        p = self.permutation
        rows.append((f"gap permutation ({p.scheme})", p.statistic, np.nan, p.pvalue, None))
        decides = self.omnibus.name
        return pd.DataFrame(
            [
                {"metric": self.metric, "test": t, "statistic": s, "df": d, "pvalue": pv, "note": note,
                 "decides": t == decides}
                for t, s, d, pv, note in rows
            ]
        )

    def __repr__(self) -> str:
        means = " ".join(f"{m:.4g}" for m in self.phase_means)
        o = self.omnibus
        tests = (f"{o.name.capitalize()} p={fmt_p(o.pvalue)} (paired; Kruskal p={fmt_p(self.kruskal.pvalue)} "
                 "ignores the pairing)" if self.paired else f"Kruskal p={fmt_p(self.kruskal.pvalue)}")
        return (
            f"ContinuousResult({self.metric}: phase means [{means}], {tests}, "
            f"gap {self.permutation.statistic:.4g} p={fmt_p(self.permutation.pvalue)})"
        )


def _guarded(name: str, df: int, fn: Callable[..., Any], *samples: np.ndarray) -> TestResult:
    """Run a scipy rank test. With nothing to rank (all values tied, or every block tied) scipy returns NaN;
    that is no evidence of a phase effect, so report statistic 0 and p 1."""
    if np.ptp(np.concatenate([np.ravel(s) for s in samples])) == 0:
        return TestResult(name, 0.0, df, 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        res = fn(*samples)
    if not np.isfinite(res.statistic):
        return TestResult(name, 0.0, df, 1.0)
    return TestResult(name, float(res.statistic), df, float(res.pvalue))


def _wilcoxon(a: np.ndarray, b: np.ndarray) -> Any:
    """Wilcoxon signed-rank test; with every difference zero there is nothing to rank (NaN, reported as p 1)."""
    if np.all(a == b):
        return SimpleNamespace(statistic=np.nan, pvalue=1.0)
    return stats.wilcoxon(a, b)


# scipy renamed permutation_test's random_state to rng in 1.15; support both.
_RNG_KEYWORD = "rng" if "rng" in inspect.signature(stats.permutation_test).parameters else "random_state"


def _ptp_of_means(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.ptp(np.stack([s.mean(axis=axis) for s in samples]), axis=0)


def ptp_permutation(groups: list[np.ndarray], n_permutations: int, seed: int) -> tuple[float, float, np.ndarray]:
    """Unpaired Monte Carlo permutation test of ``max - min`` of the group means, for any group sizes.

    scipy's ``permutation_test`` refuses a group of one observation (a residue subset with one item per
    residue); this draws the same null: the pooled values ``[N]`` shuffled ``n_permutations`` times with the
    group sizes fixed, all at once as ``[n_permutations, N]``. Returns ``(statistic, p-value, null)``, the
    p-value ``(1 + #{null >= observed}) / (n_permutations + 1)`` with scipy's relative tolerance for ties.
    """
    v = np.concatenate(groups).astype(float)
    labels = np.repeat(np.arange(len(groups)), [g.size for g in groups])
    one_hot = (labels[:, None] == np.arange(len(groups))[None, :]) / np.bincount(labels)  # [N, k]
    observed = float(np.ptp(v @ one_hot))
    rng = np.random.default_rng(seed)
    null = np.ptp(rng.permuted(np.broadcast_to(v, (n_permutations, v.size)), axis=1) @ one_hot, axis=1)
    tol = observed * 1e-14 if observed else 1e-14
    return observed, float((1 + np.count_nonzero(null >= observed - tol)) / (n_permutations + 1)), null


def continuous_phase_tests(
    values: ArrayLike | int | float, residues: ArrayLike | int | float, stride: int, modulus: int | None = None,
    *,
    item_ids: ArrayLike | None = None,
    metric: str = "value",
    n_permutations: int = 9999,
    seed: int = 0,
) -> ContinuousResult:
    """Test whether a continuous per-row metric depends on phase = residue mod ``stride``.

    Args:
        values: ``(N,)`` metric per row.
        residues: ``(N,)`` residue per row, in 0..M−1.
        stride: S (divides M).
        modulus: M; default ``max(residues) + 1`` rounded up to a multiple of S.
        item_ids: ``(N,)`` item labels; when every item appears once at every residue the design is paired
            and Friedman and the within-item permutation are used.
        metric: name for the result.
        n_permutations: permutations for the gap test.
        seed: seed for ``np.random.default_rng``.
    """
    r, stride, modulus = resolve_residues(residues, stride, modulus)
    v = check_values(values, metric, r.size)
    b = check_draws(n_permutations, "n_permutations")
    phase = r % stride
    phase_n = np.bincount(phase, minlength=stride)
    if np.count_nonzero(phase_n) < 2:
        raise StatsInputError(f"{metric} has rows at fewer than 2 phases mod {stride}; nothing to compare.")
    with np.errstate(invalid="ignore", divide="ignore"):
        phase_means = np.bincount(phase, weights=v, minlength=stride) / phase_n
    groups = [v[phase == p] for p in range(stride) if phase_n[p]]
    kruskal = _guarded("kruskal", len(groups) - 1, stats.kruskal, *groups)

    sub = residue_subset(np.unique(r), stride, modulus)  # pairing is judged over the residues with rows
    note = "no item_ids given" if item_ids is None else None
    if item_ids is not None:
        item = item_codes(item_ids, r.size)
        note = pairing(item, sub.column(r), sub.residues.size, sub.residues)
    friedman, wilcoxon, skipped = None, None, note
    if note is None:
        m = paired_matrix(item, sub.column(r), v, sub.residues.size)
        per_phase = sub.fold(m) / sub.residues_per_phase  # (items, k): each item's mean per phase present
        k = sub.phases.size
        if k < 3:
            tested = f"stride is {stride}" if sub.complete else f"{k} phases tested"
            skipped = f"Friedman needs at least 3 phases, {tested}; the Wilcoxon test replaces it"
            if k == 2:
                wilcoxon = _guarded("wilcoxon", 1, _wilcoxon, per_phase[:, 0], per_phase[:, 1])
        else:
            friedman = _guarded("friedman", k - 1, stats.friedmanchisquare, *per_phase.T)
        perm = within_item_permutation_test(m, stride, n_permutations=b, seed=seed, name=metric,
                                            phases=None if sub.complete else sub.phase_of)
    elif min(g.size for g in groups) < 2:
        stat, pvalue, null = ptp_permutation(groups, b, seed)
        perm = PermutationResult(metric, stat, pvalue, null.size, float(null.mean()), "unpaired")
    else:
        res = stats.permutation_test(
            groups,
            _ptp_of_means,
            permutation_type="independent",
            vectorized=True,
            n_resamples=b,
            batch=max(1, (1 << 22) // v.size),  # bound memory: scipy would otherwise stack all resamples
            alternative="greater",
            **{_RNG_KEYWORD: np.random.default_rng(seed)},
        )
        null = np.asarray(res.null_distribution)
        perm = PermutationResult(
            metric, float(res.statistic), float(res.pvalue), null.size, float(null.mean()), "unpaired"
        )
    return ContinuousResult(metric, phase_means, phase_n, kruskal, friedman, skipped, perm, wilcoxon)
