"""The statistics battery on per-residue counts: everything science.md §4 asks for, in one call."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from phaselens.stats._checks import (
    readonly,
)
from phaselens.stats.outcomes import GapInterval, PermutationResult, TestResult, fmt_p
from phaselens.stats.period import PeriodResult
from phaselens.stats.periodicity import HarmonicResult
from phaselens.stats.subset import ResidueSubset


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
        residue_rows = [(i, k) for k, i in enumerate(self.residues.tolist())]
        phase_rows = [(p, p) for p in np.flatnonzero(self.phase_n).tolist()]
        for section, index_rows, est, low, high in (
            ("residue", residue_rows, self.accuracy, self.ci_low, self.ci_high),
            ("phase", phase_rows, self.phase_accuracy, self.phase_ci_low, self.phase_ci_high),
        ):
            rows += [_row(section, "accuracy", index=i, estimate=est[k], ci_low=low[k], ci_high=high[k])
                     for i, k in index_rows]
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
