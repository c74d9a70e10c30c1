"""The result of ``ablate``: clean against knocked-out accuracy for one set of heads (:class:`PhaseAblation`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.heads import Head
from phaselens.results.base import Result
from phaselens.stats.effects import EFFECT_COLUMNS, Effects


@dataclass(frozen=True, repr=False, eq=False)
class PhaseAblation(Result):
    """Clean against knocked-out accuracy for one set of heads.

    ``effects`` holds ``[1, residues]`` arrays and ``phase_effects`` ``[1, phases]`` (residues folded mod S, the
    same resampling; see :class:`~phaselens.stats.effects.Effects`); ``items`` one row per item with
    ``correct`` / ``correct_ko`` and ``logit_diff`` / ``logit_diff_ko``.
    """

    LEVELS = ("residue", "phase", "item")
    COLUMNS = {
        "residue": ("residue", "phase", *EFFECT_COLUMNS),
        "phase": ("phase", *EFFECT_COLUMNS, "boundary"),
        "item": ("item_id", "residue", "phase", "correct", "correct_ko", "logit_diff", "logit_diff_ko"),
    }

    heads: tuple[Head, ...]
    method: str
    effects: Effects
    phase_effects: Effects
    items: pd.DataFrame
    stride: int
    modulus: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def per_residue(self) -> pd.DataFrame:
        """One row per residue with items: clean and KO accuracy, relative change with its bootstrap CI,
        McNemar p, and the mean change of the logit difference."""
        return _frame(self.effects, self.modulus, self.stride, "residue")

    def per_phase(self) -> pd.DataFrame:
        """Residues folded mod S: the same columns per phase, plus ``boundary``."""
        out = _frame(self.phase_effects, self.stride, self.stride, "phase")
        out["boundary"] = out["phase"] == self.stride - 1
        return out

    def per_item(self) -> pd.DataFrame:
        return self.items.copy()

    def summary(self) -> str:
        ph = self.per_phase()
        heads = ", ".join(map(str, self.heads[:6])) + ("..." if len(self.heads) > 6 else "")
        lines = [f"PhaseAblation: knock out {heads} ({self.method}) on {len(self.items)} items, stride {self.stride}"]
        for row in ph.itertuples():
            rc = "undefined (clean acc < 2%)" if row.undefined else (
                f"{row.rel_change:+.1f}% [{row.ci_low:+.1f}, {row.ci_high:+.1f}], p={row.pvalue:.2g}")
            lines.append(f"  phase {row.phase}{' (boundary)' if row.boundary else ''}: clean {100 * row.clean_acc:.1f}% "
                         f"-> KO {100 * row.ko_acc:.1f}%  ({rc})")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        return self._figure("phase_rose", **kwargs)


def _frame(e: Effects, n_groups: int, stride: int, level: str) -> pd.DataFrame:
    g = np.arange(n_groups)
    df = pd.DataFrame({
        level: g, **({"phase": g % stride} if level == "residue" else {}), "n": e.n,
        "clean_acc": e.clean_acc, "ko_acc": e.ko_acc[0], "rel_change": e.rel_change[0],
        "ci_low": e.ci_low[0], "ci_high": e.ci_high[0], "pvalue": e.pvalue[0],
        "delta_logit_diff": e.delta_logit_diff[0], "undefined": e.undefined[0],
    })
    return df[df["n"] > 0].reset_index(drop=True)
