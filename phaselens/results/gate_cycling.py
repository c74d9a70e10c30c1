"""The result of ``gate_cycling_test``: observed against predicted per-phase accuracy under gate cycling (:class:`PhaseGateCycling`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.results.base import Result


@dataclass(frozen=True, repr=False, eq=False)
class PhaseGateCycling(Result):
    """Observed against predicted per-phase accuracy under gate cycling.

    Attributes:
        frame: rows (``delta``, ``phase``, ``observed``, ``predicted``, ``boundary``).
        r2: R^2 of observed against predicted (identity line), pooled over deltas, boundary phase excluded.
            A negative R^2 means the prediction "the profile moves with the gates" fits worse than a flat
            line at the observed mean: the weak phases did not move with the gate parameters.
        r2_all: the same with the boundary phase included.
        boundary: accuracy of the boundary phase under each delta (``{delta: acc}``), reported separately.
        base: per-phase accuracy of the unmodified model.
        r2_ci, r2_all_ci: 95% intervals of ``r2`` and ``r2_all`` (:func:`r2_bootstrap_ci`; NaN when
            ``n_bootstrap`` was 0).
        evals: the :class:`~phaselens.evaluate.PhaseEval` of each delta (0: the unmodified model).
    """

    LEVELS = ("residue", "phase")
    COLUMNS = {
        "residue": ("residue", "phase", "n", "correct", "acc", "ci_low", "ci_high", "nll", "delta"),
        "phase": ("phase", "n", "correct", "acc", "ci_low", "ci_high", "boundary", "delta", "predicted"),
    }

    frame: pd.DataFrame
    r2: float
    r2_all: float
    boundary: dict[int, float]
    base: np.ndarray
    stride: int
    evals: dict[int, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    r2_ci: tuple[float, float] = (float("nan"), float("nan"))
    r2_all_ci: tuple[float, float] = (float("nan"), float("nan"))

    def per_residue(self) -> pd.DataFrame:
        """Accuracy per residue under each delta (``delta`` 0 is the unmodified model), with Wilson CIs."""
        return pd.concat([ev.per_residue().assign(delta=d) for d, ev in self.evals.items()], ignore_index=True)

    def per_phase(self) -> pd.DataFrame:
        """Per delta and phase: ``acc`` (observed), ``predicted`` (the unmodified profile rolled by delta),
        Wilson ``ci_low`` / ``ci_high`` and ``n``; ``boundary`` marks phase S - 1."""
        rows = []
        for d, ev in self.evals.items():
            ph = ev.per_phase().assign(delta=d)
            ph["predicted"] = self.base[(ph["phase"].to_numpy() - d) % self.stride]
            rows.append(ph)
        return pd.concat(rows, ignore_index=True)

    def summary(self) -> str:
        b = ", ".join(f"{d:+d}: {100 * a:.1f}%" for d, a in self.boundary.items())
        if not np.isfinite(self.r2):  # no variation to explain: the test says nothing either way
            return (f"PhaseGateCycling(stride {self.stride}: R^2 undefined without the boundary phase: the "
                    "observed accuracy does not vary over the phases, so this test cannot tell whether the weak "
                    "phases move with the gates (use more items, or a harder task); boundary accuracy by delta "
                    f"{b})")
        return (f"PhaseGateCycling(stride {self.stride}: R^2 {self.r2:.2f} [95% CI {self.r2_ci[0]:.2f}, "
                f"{self.r2_ci[1]:.2f}] without the boundary phase ({self.r2_all:.2f} with it; below 0: the weak "
                f"phases did not move with the gates); boundary accuracy by delta {b})")

    def plot(self, **kwargs: Any):
        return self._figure("gate_cycling_scatter", **kwargs)
