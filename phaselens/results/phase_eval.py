"""The result of ``evaluate``: per-item and per-residue accuracy with its statistics battery (:class:`PhaseEval`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.results.base import Result
from phaselens.stats import ItemBattery, wilson_ci
from phaselens.stats.by_residue import group_counts, group_mean


@dataclass(frozen=True, repr=False, eq=False)
class PhaseEval(Result):
    """Per-item and per-residue results of a phase-aware evaluation.

    Attributes:
        items: one row per item (``item_id``, ``residue``, ``phase``, ``t_K``, ``correct``, ``p_correct``,
            ``p_wrong``, ``logit_diff``, ``nll``, ``rank``, ``predicted`` (the greedy token id: what the model
            answered) and the task's placement columns). A served model without log-probabilities leaves
            ``p_correct`` .. ``nll`` NaN (``metadata["scored_by"]`` says so).
        tests: the statistics battery run on these items (:class:`~phaselens.stats.ItemBattery`); its
            ``counts`` holds the per-residue counts, Wilson CIs, omnibus, nested and harmonic tests.
        stride, modulus: S and M.
        metadata: what was run (model, its ``analysis_metadata``, task spec, the exact arguments).
    """

    LEVELS = ("residue", "phase", "item")
    COLUMNS = {
        "residue": ("residue", "phase", "n", "correct", "acc", "ci_low", "ci_high", "nll"),
        "phase": ("phase", "n", "correct", "acc", "ci_low", "ci_high", "boundary"),
        "item": ("item_id", "residue", "phase", "t_K", "correct", "p_correct", "p_wrong", "logit_diff", "nll", "rank",
                 "predicted"),
    }

    items: pd.DataFrame
    tests: ItemBattery
    stride: int
    modulus: int
    metadata: dict[str, Any] = field(default_factory=dict)

    # ---- headline numbers (fractions) -------------------------------------------------------------------
    @property
    def mean(self) -> float:
        return self.tests.counts.mean_accuracy

    @property
    def worst(self) -> float:
        """Accuracy of the worst phase (residues folded mod S); alias of ``worst_phase_accuracy``."""
        return self.tests.counts.worst_accuracy

    @property
    def worst_phase_accuracy(self) -> float:
        """Accuracy of the worst phase (residues folded mod S)."""
        return self.tests.counts.worst_accuracy

    @property
    def best_phase_accuracy(self) -> float:
        """Accuracy of the best phase (residues folded mod S)."""
        return self.tests.counts.best_accuracy

    @property
    def phase_gap(self) -> float:
        """Max - min accuracy over phases (residues folded mod S)."""
        return self.tests.counts.phase_gap

    @property
    def worst_residue(self) -> int:
        """The residue (0..M-1, not folded) with the lowest accuracy."""
        return self.tests.counts.worst_residue

    @property
    def worst_residue_accuracy(self) -> float:
        """Lowest accuracy over the M residues, not folded: the paper's "worst"."""
        return self.tests.counts.worst_residue_accuracy

    @property
    def best_residue(self) -> int:
        """The residue (0..M-1, not folded) with the highest accuracy."""
        return self.tests.counts.best_residue

    @property
    def best_residue_accuracy(self) -> float:
        """Highest accuracy over the M residues, not folded: the paper's "best"."""
        return self.tests.counts.best_residue_accuracy

    @property
    def residue_gap(self) -> float:
        """Max - min accuracy over the M residues, not folded: the paper's "gap across residues"."""
        return self.tests.counts.residue_gap

    @property
    def worst_phase(self) -> int:
        return self.tests.counts.worst_phase

    @property
    def best(self) -> float:
        """Accuracy of the best phase (residues folded mod S); alias of ``best_phase_accuracy``."""
        return self.tests.counts.best_accuracy

    @property
    def gap(self) -> float:
        """Folded max - min accuracy over phases; alias of ``phase_gap`` (see ``residue_gap`` for the paper's)."""
        return self.tests.counts.phase_gap

    @property
    def gap_ci(self) -> tuple[float, float]:
        """95% interval of the folded gap (``phase_gap``)."""
        ci = self.tests.gap_ci
        return (ci.ci_low, ci.ci_high) if ci is not None else (float("nan"), float("nan"))

    @property
    def gap_upper_bound(self) -> float:
        """One-sided 95% upper bound of the folded gap: the equivalence margin."""
        ci = self.tests.gap_ci
        return ci.upper_bound if ci is not None else float("nan")

    @property
    def boundary(self) -> float:
        """Accuracy of the boundary phase S - 1."""
        return self.tests.counts.boundary_accuracy

    @property
    def period(self) -> int | None:
        """Detected period (paired tests when items are paired); ``None`` for no effect, an ambiguous one, or a
        subset of residues (period detection needs the whole cycle: ``tests.skipped["period"]``)."""
        return None if self.tests.period is None else self.tests.period.period

    @property
    def residues(self) -> np.ndarray:
        """The residues evaluated (all of 0..M-1 unless ``residues=`` was passed)."""
        return self.tests.counts.residues

    def per_residue(self) -> pd.DataFrame:
        """One row per residue: ``n``, ``correct``, ``acc``, Wilson 95% ``ci_low`` / ``ci_high``, mean NLL."""
        res = self.items["residue"].to_numpy()
        n = group_counts(res, self.modulus)
        correct = np.rint(group_mean(self.items["correct"].to_numpy(float), res, self.modulus) * n)
        correct = np.nan_to_num(correct).astype(int)
        lo, hi = np.full(self.modulus, np.nan), np.full(self.modulus, np.nan)
        has = n > 0
        lo[has], hi[has] = wilson_ci(correct[has], n[has])
        out = pd.DataFrame({"residue": np.arange(self.modulus), "phase": np.arange(self.modulus) % self.stride,
                            "n": n, "correct": correct, "acc": np.where(n > 0, correct / np.maximum(n, 1), np.nan),
                            "ci_low": lo, "ci_high": hi,
                            "nll": group_mean(self.items["nll"].to_numpy(float), res, self.modulus)})
        return out[out["n"] > 0].reset_index(drop=True)

    def per_phase(self) -> pd.DataFrame:
        """Residues folded mod S: one row per phase with Wilson CIs, and a ``boundary`` flag."""
        return self.tests.counts.phase_frame().rename(columns={"accuracy": "acc"})

    def per_item(self) -> pd.DataFrame:
        """The per-item frame (tidy: one row per scored item)."""
        return self.items.copy()

    def summary(self) -> str:
        lo, hi = self.gap_ci
        c, t = self.tests.counts, self.tests
        md = self.metadata
        boundary = (f"boundary phase {self.stride - 1}: {100 * self.boundary:.1f}%" if c.phase_n[-1]
                    else f"boundary phase {self.stride - 1} not evaluated")
        tests = [f"folded gap {100 * self.gap:.1f} pp [95% CI {100 * lo:.1f}, {100 * hi:.1f}]"
                 if np.count_nonzero(c.phase_n) > 1 else "one phase evaluated: no folded gap"]
        if c.gap_test is not None:
            tests[0] += f", permutation p={c.gap_test.pvalue:.3g}"
        if t.omnibus is not None:
            tests.append(f"omnibus {t.omnibus.name} p={t.omnibus.pvalue:.3g}")
        if t.nested is not None:
            what = f"mod {self.modulus} vs {self.stride}" if c.complete else "residues vs phases"
            tests.append(f"nested {what} p={t.nested.pvalue:.3g}")
        tests.append(f"period {self.period}" if t.period is not None else "period not tested (needs every residue)")
        lines = [
            f"PhaseEval: {md.get('model', 'model')} on {md.get('task', 'task')}: {len(self.items)} items, "
            f"stride {self.stride}, residues mod {self.modulus}"
            + ("" if c.complete else f"; evaluated {c.subset.describe()}"),
            f"  mean {100 * self.mean:.1f}%  worst phase {self.worst_phase}: {100 * self.worst:.1f}%  "
            f"{boundary}  best {100 * self.best:.1f}%",
            f"  per residue: worst {self.worst_residue}: {100 * self.worst_residue_accuracy:.1f}%  "
            f"best {self.best_residue}: {100 * self.best_residue_accuracy:.1f}%  gap {100 * self.residue_gap:.1f} pp",
            "  " + "; ".join(tests),
            "  accuracy by phase %: " + " ".join(f"{p}: {100 * c.phase_accuracy[p]:.1f}"
                                                 for p in np.flatnonzero(c.phase_n)),
        ]
        if md.get("scored_by"):  # a served model: how its answers were scored (accuracy only, or log-probs too)
            lines.append(f"  scored by {md['scored_by']}")
        return "\n".join(lines)

    def plot(self, control: PhaseEval | None = None, **kwargs: Any):
        """Accuracy against residue with Wilson bars, folded per cycle (see :func:`phaselens.plots.accuracy_by_residue`)."""
        return self._figure("accuracy_by_residue", control=control, **kwargs)
