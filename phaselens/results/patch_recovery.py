"""The result of ``patch``: normalized recovery per head and residue (:class:`PhasePatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.heads import Head
from phaselens.core.labelled import Labelled
from phaselens.results.base import Result


@dataclass(frozen=True, repr=False, eq=False)
class PhasePatch(Result):
    """Normalized recovery per head and residue.

    Denoising: ``(M_patched - M_corrupt) / (M_clean - M_corrupt)``; noising:
    ``(M_clean - M_patched) / (M_clean - M_corrupt)``; each a ratio of means over a group's items (a
    residue, or a phase), with ``M`` the answer-minus-wrong logit difference. NaN (and ``undefined``) where
    ``|M_clean - M_corrupt|`` is below ``eps``.

    Attributes:
        recovery: ``Labelled[layer, head, residue]`` with 95% bootstrap CIs (items resampled per residue).
        undefined: ``[layer, head, residue]`` bool; m_clean, m_corrupt: ``[residue]``; m_patched:
            ``[layer, head, residue]`` (group means of the logit difference).
        logit_diff, logit_diff_corrupt: ``[N]`` (clean and corrupted items), logit_diff_patched:
            ``[heads, N]``, residue: ``[N]`` (per-item values, named as in every result).
        residue_frame, phase_frame: the tidy levels, computed once with the run's resampling.
    """

    LEVELS = ("residue", "phase")
    COLUMNS = {
        "residue": ("layer", "head", "residue", "phase", "n", "recovery", "ci_low", "ci_high", "undefined",
                    "m_clean", "m_corrupt", "m_patched"),
        "phase": ("layer", "head", "phase", "n", "recovery", "ci_low", "ci_high", "undefined", "m_clean",
                  "m_corrupt", "m_patched", "boundary"),
    }

    recovery: Labelled
    undefined: np.ndarray
    m_clean: np.ndarray
    m_corrupt: np.ndarray
    m_patched: np.ndarray
    heads: tuple[Head, ...]
    direction: str
    stride: int
    modulus: int
    logit_diff: np.ndarray
    logit_diff_corrupt: np.ndarray
    logit_diff_patched: np.ndarray
    residue: np.ndarray
    residue_frame: pd.DataFrame
    phase_frame: pd.DataFrame
    metadata: dict[str, Any] = field(default_factory=dict)


    def per_residue(self) -> pd.DataFrame:
        """Tidy rows per (layer, head, residue): recovery with its CI, ``undefined``, and the group means
        M_clean / M_corrupt / M_patched."""
        return self.residue_frame.copy()

    def per_phase(self) -> pd.DataFrame:
        """The same per (layer, head, phase): residues folded mod S."""
        return self.phase_frame.copy()

    def summary(self) -> str:
        v = self.recovery.values
        best = np.unravel_index(np.nanargmax(np.nan_to_num(v, nan=-np.inf)), v.shape) if np.isfinite(v).any() else None
        where = f"; largest: L{best[0]}H{best[1]} residue {best[2]} ({v[best]:.2f})" if best else ""
        return f"PhasePatch({self.direction}, {len(self.heads)} heads x {self.modulus} residues{where})"

    def plot(self, **kwargs: Any):
        return self._figure("patch_heatmap", **kwargs)
