"""The result of ``repair_table``: repaired against unrepaired accuracy per shift set and combining rule (:class:`PhaseRepairTable`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from phaselens.results.base import Result
from phaselens.results.phase_eval import PhaseEval


@dataclass(frozen=True, repr=False, eq=False)
class PhaseRepairTable(Result):
    """Repaired against unrepaired accuracy.

    Attributes:
        rows: one row per (shift set, rule) plus the unrepaired baseline: ``cost`` (forward multiple), ``mean``,
            ``worst``, ``worst_phase``, ``boundary``, ``gap`` with its 95% CI, ``any_copy_right`` (the share of
            items some copy answers correctly: an upper bound for any rule), the battery's ``p_chi2`` and
            ``period`` on the repaired counts.
        evals: the :class:`PhaseEval` of each row, keyed like ``("all", "max_conf")``; ``("none", "none")`` is
            the unrepaired model.
    """

    rows: pd.DataFrame
    evals: dict[tuple[str, str], PhaseEval]
    stride: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> PhaseEval:
        return self.evals[("none", "none")]

    def best(self) -> tuple[str, str]:
        rep = self.rows[self.rows["shifts"] != "none"]
        r = rep.sort_values(["worst", "mean"], ascending=False).iloc[0]
        return str(r["shifts"]), str(r["combine"])

    LEVELS = ("residue", "phase", "rule")
    COLUMNS = {
        "residue": ("shifts", "combine", "residue", "phase", "n", "correct", "acc", "ci_low", "ci_high", "nll"),
        "phase": ("shifts", "combine", "phase", "n", "correct", "acc", "ci_low", "ci_high", "boundary"),
        "rule": ("shifts", "combine", "cost"),
    }

    def per_rule(self) -> pd.DataFrame:
        """One row per (shift set, combining rule) and the baseline (the summary table)."""
        return self.rows.copy()

    def _stack(self, level: str) -> pd.DataFrame:
        parts = [getattr(ev, "per_" + level)().assign(shifts=k[0], combine=k[1]) for k, ev in self.evals.items()]
        out = pd.concat(parts, ignore_index=True)
        return out[["shifts", "combine", *[c for c in out.columns if c not in ("shifts", "combine")]]]

    def per_residue(self) -> pd.DataFrame:
        """Accuracy per residue for every row (``shifts``, ``combine``; ``none`` is the unrepaired model)."""
        return self._stack("residue")

    def per_phase(self) -> pd.DataFrame:
        """Accuracy per phase for every row, with Wilson CIs and ``boundary``."""
        return self._stack("phase")

    def summary(self) -> str:
        lines = [f"PhaseRepairTable (stride {self.stride}; accuracies in %)"]
        for r in self.rows.itertuples():
            lines.append(f"  {r.shifts:>8} {r.combine:>12} x{r.cost}: mean {100 * r.mean:.1f}, worst {100 * r.worst:.1f}, "
                         f"gap {100 * r.gap:.1f} [{100 * r.gap_ci_low:.1f}, {100 * r.gap_ci_high:.1f}], "
                         f"any-copy {100 * r.any_copy_right:.1f}, p={r.p_chi2:.2g}, period {r.period}")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        return self._figure("repair_panel", **kwargs)
