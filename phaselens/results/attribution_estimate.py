"""The result of ``attribution_map``: the estimated change of the logit difference per layer, head and residue (:class:`PhaseAttribution`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.labelled import Labelled
from phaselens.results.base import Result
from phaselens.stats.by_residue import residue_mean_ci


@dataclass(frozen=True, repr=False, eq=False)
class PhaseAttribution(Result):
    """Estimated change of the logit difference per ``[layer, head, residue]`` (mean over items, t CI).

    ``spearman`` is the rank correlation with an exact :class:`~phaselens.results.phase_map.PhaseMap`'s
    ``delta_logit_diff`` over the same cells, when one was given. ``values`` ``[N, layer, head]`` holds the
    per-item estimates, ``residue`` ``[N]``.
    """

    LEVELS = ("residue", "phase")
    COLUMNS = {
        "residue": ("quantity", "layer", "head", "residue", "phase", "value", "ci_low", "ci_high"),
        "phase": ("quantity", "layer", "head", "phase", "value", "ci_low", "ci_high", "boundary"),
    }

    estimate: Labelled
    spearman: float | None
    method: str
    stride: int
    modulus: int
    values: np.ndarray
    residue: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)


    def per_residue(self) -> pd.DataFrame:
        """Tidy rows per (layer, head, residue): ``value`` with ``ci_low`` / ``ci_high``."""
        out = self.estimate.to_frame()
        out.insert(out.columns.get_loc("residue") + 1, "phase", out["residue"] % self.stride)
        return out[out["residue"].isin(np.unique(self.residue))].reset_index(drop=True)  # residues with items

    def per_phase(self) -> pd.DataFrame:
        """The same per (layer, head, phase): residues folded mod S."""
        m, lo, hi = residue_mean_ci(self.values, self.residue % self.stride, self.stride)
        c = self.estimate.coords
        lab = Labelled(m, ("layer", "head", "phase"), {"layer": c["layer"], "head": c["head"],
                                                       "phase": np.arange(self.stride)}, lo, hi, name=self.estimate.name)
        out = lab.to_frame()
        out["boundary"] = out["phase"] == self.stride - 1
        return out[out["phase"].isin(np.unique(self.residue % self.stride))].reset_index(drop=True)

    def plot(self, **kwargs: Any):
        return self._figure("attribution_heatmap", **kwargs)

    def summary(self) -> str:
        rho = "n/a" if self.spearman is None else f"{self.spearman:.3f}"
        return f"PhaseAttribution({self.method}; stride {self.stride}, residues mod {self.modulus}; Spearman vs exact: {rho})"
