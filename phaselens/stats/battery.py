"""The statistics battery on per-residue counts: everything science.md §4 asks for, in one call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from phaselens.core.errors import ResidueError
from phaselens.stats._checks import (
    check_alpha,
    check_draws,
    check_level,
    check_stride,
    readonly,
    resolve_residues,
)
from phaselens.stats.gapci import MIN_DRAWS, gap_ci
from phaselens.stats.intervals import wilson_ci
from phaselens.stats.omnibus import chi2_test, g_test
from phaselens.stats.outcomes import GapInterval, PermutationResult, TestResult, fmt_p
from phaselens.stats.period import PeriodResult, detect_period
from phaselens.stats.periodicity import HarmonicResult, harmonic_fraction, nested_fold_test
from phaselens.stats.published import counts_from_accuracy
from phaselens.stats.resampling import gap_permutation_test
from phaselens.stats.subset import ResidueSubset, count_tests, residue_subset


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _row(section: str, quantity: str, **values: object) -> dict[str, object]:
    """One row of a long results frame; the columns it leaves out become NaN."""
    return {"section": section, "quantity": quantity, **values}


@dataclass(frozen=True, repr=False, eq=False)
class PhaseBattery:
    """Result of :func:`phase_battery`. Accuracies are fractions in [0, 1]; gaps are fractions too.

    Attributes:
        stride, modulus: S and M.
        alpha, level: test level and confidence level used.
        correct, n: ``(K,)`` counts at each residue of ``residues`` (K = M unless a subset was tested).
        accuracy, ci_low, ci_high: ``(K,)`` accuracy per residue and its Wilson interval.
        phase_correct, phase_n: ``(S,)`` counts folded mod S (summed over the residues of a phase; 0 for a
            phase with no residue tested).
        phase_accuracy, phase_ci_low, phase_ci_high: ``(S,)`` accuracy per phase and its Wilson interval
            (NaN for a phase with no residue tested).
        mean_accuracy: pooled accuracy Σ correct / Σ n.
        worst_phase, worst_accuracy, best_phase, best_accuracy: extremes of ``phase_accuracy`` (folded mod S;
            also reachable as ``worst_phase_accuracy`` / ``best_phase_accuracy``).
        worst_residue, worst_residue_accuracy, best_residue, best_residue_accuracy: extremes of ``accuracy``
            over the M residues, not folded: the paper's "worst" and "best" (Flash-Base 29.69 / 69.92 %).
        boundary_accuracy: accuracy of the boundary phase S − 1 (NaN when it was not tested).
        residue_gap: max − min of ``accuracy`` over the M residues (the paper's "gap across residues").
        phase_gap: max − min of ``phase_accuracy`` (folded).
        chi2, g: omnibus tests on the 2 × K table.
        nested: nested fold test, mod M against mod S (residues tested against their phases for a subset).
        harmonic: harmonic-energy fraction at period S, with its null and permutation p.
        gap_test: unpaired permutation test of ``phase_gap``.
        gap_ci: interval and one-sided equivalence bound of ``phase_gap`` (:func:`~phaselens.stats.gapci.gap_ci`;
            ``None`` when ``n_bootstrap=0``).
        period: detected period (:func:`~phaselens.stats.period.detect_period`; ``period.period`` is ``None``
            when there is no effect or the data cannot single out a period, and ``period.status`` says which).
        input_note: how the counts were made when accuracies were passed (``None`` for counts).
        residues: ``(K,)`` the residues tested (all of 0..M−1 unless a subset was passed).
        skipped: test name → why it is ``None`` (on a subset of residues: the harmonic fraction and the period
            need the whole cycle; see :mod:`phaselens.stats.subset`).
    """

    stride: int
    modulus: int
    alpha: float
    level: float
    correct: np.ndarray
    n: np.ndarray
    accuracy: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    phase_correct: np.ndarray
    phase_n: np.ndarray
    phase_accuracy: np.ndarray
    phase_ci_low: np.ndarray
    phase_ci_high: np.ndarray
    mean_accuracy: float
    worst_phase: int
    worst_accuracy: float
    best_phase: int
    best_accuracy: float
    boundary_accuracy: float
    residue_gap: float
    phase_gap: float
    chi2: TestResult | None
    g: TestResult | None
    nested: TestResult | None
    harmonic: HarmonicResult | None
    gap_test: PermutationResult | None
    gap_ci: GapInterval | None
    period: PeriodResult | None
    worst_residue: int = -1
    worst_residue_accuracy: float = float("nan")
    best_residue: int = -1
    best_residue_accuracy: float = float("nan")
    input_note: str | None = None
    residues: np.ndarray = None  # type: ignore[assignment]  # set to 0..M-1 when not given
    skipped: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.residues is None:
            object.__setattr__(self, "residues", np.arange(self.modulus))
        readonly(*(v for v in vars(self).values() if isinstance(v, np.ndarray)))

    @property
    def complete(self) -> bool:
        """Whether every residue 0..M−1 was tested."""
        return self.residues.size == self.modulus

    @property
    def worst_phase_accuracy(self) -> float:
        """Accuracy of the worst phase (residues folded mod S); the same as ``worst_accuracy``."""
        return self.worst_accuracy

    @property
    def best_phase_accuracy(self) -> float:
        """Accuracy of the best phase (residues folded mod S); the same as ``best_accuracy``."""
        return self.best_accuracy

    def residue_frame(self) -> pd.DataFrame:
        """One row per residue: counts, accuracy and Wilson bounds."""
        return pd.DataFrame(
            {
                "residue": self.residues,
                "phase": self.residues % self.stride,
                "correct": self.correct,
                "n": self.n,
                "accuracy": self.accuracy,
                "ci_low": self.ci_low,
                "ci_high": self.ci_high,
            }
        )

    def phase_frame(self) -> pd.DataFrame:
        """One row per phase tested (residues folded mod S)."""
        frame = pd.DataFrame(
            {
                "phase": np.arange(self.stride),
                "correct": self.phase_correct,
                "n": self.phase_n,
                "accuracy": self.phase_accuracy,
                "ci_low": self.phase_ci_low,
                "ci_high": self.phase_ci_high,
                "boundary": np.arange(self.stride) == self.stride - 1,
            }
        )
        return frame[frame["n"] > 0].reset_index(drop=True)

    def tests_frame(self) -> pd.DataFrame:
        """One row per test run: name, statistic, df (NaN for permutation tests), p-value (see ``skipped``
        for those not run)."""
        rows: list[tuple[str, float, float, float]] = [
            (t.name, t.statistic, t.df, t.pvalue) for t in (self.chi2, self.g, self.nested) if t is not None
        ]
        if (h := self.harmonic) is not None:
            rows.append(("harmonic_fraction", h.fraction, np.nan, h.pvalue))
        if (g := self.gap_test) is not None:
            rows.append(("folded_gap permutation (unpaired)", g.statistic, np.nan, g.pvalue))
        return pd.DataFrame(rows, columns=["test", "statistic", "df", "pvalue"])

    def to_frame(self) -> pd.DataFrame:
        """Everything in one tidy long frame: ``section``, ``quantity``, ``index``, ``estimate``, ``ci_low``,
        ``ci_high``, ``statistic``, ``df``, ``pvalue`` (columns that do not apply are NaN)."""
        rows: list[dict[str, object]] = []
        for k, i in enumerate(self.residues.tolist()):
            rows.append(
                _row(
                    "residue",
                    "accuracy",
                    index=i,
                    estimate=self.accuracy[k],
                    ci_low=self.ci_low[k],
                    ci_high=self.ci_high[k],
                )
            )
        for p in np.flatnonzero(self.phase_n).tolist():
            rows.append(
                _row(
                    "phase",
                    "accuracy",
                    index=p,
                    estimate=self.phase_accuracy[p],
                    ci_low=self.phase_ci_low[p],
                    ci_high=self.phase_ci_high[p],
                )
            )
        ci = self.gap_ci
        for name, value, idx in (
            ("mean_accuracy", self.mean_accuracy, None),
            ("worst_residue_accuracy", self.worst_residue_accuracy, self.worst_residue),
            ("best_residue_accuracy", self.best_residue_accuracy, self.best_residue),
            ("worst_phase_accuracy", self.worst_accuracy, self.worst_phase),
            ("best_phase_accuracy", self.best_accuracy, self.best_phase),
            ("boundary_phase_accuracy", self.boundary_accuracy, self.stride - 1),
            ("residue_gap", self.residue_gap, None),
        ):
            rows.append(_row("summary", name, index=idx, estimate=value))
        rows.append(
            _row(
                "summary",
                "phase_gap",
                estimate=self.phase_gap,
                ci_low=ci.ci_low if ci else np.nan,
                ci_high=ci.ci_high if ci else np.nan,
                statistic=self.gap_test.statistic if self.gap_test else np.nan,
                pvalue=self.gap_test.pvalue if self.gap_test else np.nan,
            )
        )
        for t in self.tests_frame().itertuples():
            rows.append(_row("test", t.test, statistic=t.statistic, df=t.df, pvalue=t.pvalue))
        if self.period is not None:
            rows.append(_row("period", "detected_period", estimate=self.period.period))
        cols = ["section", "quantity", "index", "estimate", "ci_low", "ci_high", "statistic", "df", "pvalue"]
        return pd.DataFrame(rows).reindex(columns=cols).astype({"index": "Int64", "df": "Int64"})

    def summary(self) -> str:
        """A few readable lines; accuracies and gaps in percent."""
        pc = int(round(100 * self.level))
        phases = ", ".join(
            f"{p}: {_pct(self.phase_accuracy[p])} [{_pct(self.phase_ci_low[p])}, {_pct(self.phase_ci_high[p])}]"
            for p in np.flatnonzero(self.phase_n)
        )
        g = self.gap_ci
        ci = (f", {pc}% CI [{_pct(g.ci_low)}, {_pct(g.ci_high)}], one-sided upper {_pct(g.upper_bound)}"
              if g else "")
        boundary = (f"boundary {self.stride - 1} ({_pct(self.boundary_accuracy)}%)" if self.phase_n[-1]
                    else f"boundary {self.stride - 1} not tested")
        lines = [
            f"Phase battery: stride {self.stride}, modulus {self.modulus}, {int(self.n.sum())} trials",
            *([f"  input: {self.input_note}"] if self.input_note else []),
            *([f"  tested: {self.subset.describe()}"] if not self.complete else []),
            "  residue accuracy %: " + " ".join(_pct(a) for a in self.accuracy),
            f"  phase accuracy % [{pc}% Wilson]: {phases}",
            f"  mean {_pct(self.mean_accuracy)}%; per residue: worst {self.worst_residue} "
            f"({_pct(self.worst_residue_accuracy)}%), best {self.best_residue} ({_pct(self.best_residue_accuracy)}%), "
            f"gap {_pct(self.residue_gap)} pp",
            f"  per phase: worst {self.worst_phase} ({_pct(self.worst_accuracy)}%), "
            f"best {self.best_phase} ({_pct(self.best_accuracy)}%), {boundary}, "
            f"folded gap {_pct(self.phase_gap)} pp",
        ]
        if (gt := self.gap_test) is not None:
            lines.append(f"  folded gap: permutation p={fmt_p(gt.pvalue)}, null mean {_pct(gt.null_mean)} pp{ci}")
        if self.chi2 is not None and self.g is not None:
            lines.append(f"  omnibus: chi2={self.chi2.statistic:.2f} (df {self.chi2.df}) p={fmt_p(self.chi2.pvalue)}; "
                         f"G={self.g.statistic:.2f} p={fmt_p(self.g.pvalue)}")
        if (n := self.nested) is not None:
            what = (f"mod {self.modulus} vs mod {self.stride}" if self.complete
                    else f"{self.residues.size} residues vs their {np.count_nonzero(self.phase_n)} phases")
            lines.append(f"  nested {what}: G={n.statistic:.3f} (df {n.df}) p={fmt_p(n.pvalue)}")
        if (h := self.harmonic) is not None:
            lines.append(f"  harmonic fraction {h.fraction:.4f} (null {h.null_fraction:.4f}) p={fmt_p(h.pvalue)}")
        if (pr := self.period) is not None:
            lines.append(f"  detected period: {pr.period} ({pr.status}"
                         + (f"; candidates {list(pr.candidates)}" if pr.status == "ambiguous" else "")
                         + f"; alpha {self.alpha})")
        lines.extend(f"  not run: {name}: {why}" for name, why in self.skipped.items())
        return "\n".join(lines)

    @property
    def subset(self) -> ResidueSubset:
        """The residues tested, as a :class:`~phaselens.stats.subset.ResidueSubset`."""
        return ResidueSubset(np.array(self.residues), self.stride, self.modulus)

    def __repr__(self) -> str:
        return self.summary()


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
