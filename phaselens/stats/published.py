"""Analyses of published figures as they are published: accuracies with n, derived per-phase tables, and
layer × residue matrices, rather than per-item counts.

* :func:`counts_from_accuracy`: percentages (or fractions) with the number of trials back to whole counts,
  checking that the counts reproduce every printed value at its printed precision.
* :func:`gate_cycling_summary`: the paper's gate-cycling numbers from a clean per-phase profile and the
  observed profile under each gate shift δ (prediction: the clean profile rolled by δ).
* :func:`knockout_summary`: which phases each knockout hurts, from a matrix of relative accuracy changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from phaselens.errors import StatsInputError
from phaselens.stats._checks import check_counts, check_stride, readonly

SCALES = ("auto", "counts", "percent", "fraction")


def _decimals(x: float) -> int:
    """Decimals in the shortest representation of ``x`` (its printed precision), at most 10."""
    text = np.format_float_positional(float(x), trim="-")
    return min(10, len(text.split(".")[1])) if "." in text else 0


def counts_from_accuracy(
    accuracy: ArrayLike | int | float, n: ArrayLike | int | float, scale: str = "auto"
) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Whole counts from published accuracies and the number of trials behind each.

    ``counts = round(accuracy × n)`` (÷ 100 for percentages). The counts must reproduce every accuracy at the
    precision it was printed with (68.2 → one decimal); otherwise ``n`` cannot be right and this raises.

    Args:
        accuracy: ``(M,)`` accuracies (or whole counts: see ``scale``).
        n: an int or ``(M,)`` trials per entry.
        scale: ``"percent"``, ``"fraction"``, ``"counts"``, or ``"auto"``: whole numbers are counts (as
            everywhere else in phaselens); values with decimals are percentages when any exceeds 1, else
            fractions.

    Returns:
        ``(correct, n, note)``: int64 counts and trials, and a sentence saying how they were made (``None`` when
        the input already was counts).

    Example:
        >>> c, n, note = counts_from_accuracy([68.2, 71.5, 77.7, 44.6], 1000)
        >>> c.tolist(), note
        ([682, 715, 777, 446], 'accuracies in % with n = 1000 per residue, rounded to whole counts (every printed value reproduced)')
    """
    if scale not in SCALES:
        raise StatsInputError(f"scale must be one of {SCALES}, got {scale!r}.")
    raw = np.asarray(accuracy)
    plain = raw.size == 0 or raw.ndim != 1 or raw.dtype.kind not in "biuf" or not np.all(np.isfinite(raw))
    if plain or scale == "counts" or (scale == "auto" and np.all(raw == np.round(raw))):
        c, t = check_counts(raw, n)  # counts as everywhere else (and its errors for malformed input)
        return c, t, None
    a = raw.astype(np.float64)
    if scale == "auto":
        scale = "percent" if a.max() > 1 else "fraction"
    unit = 100.0 if scale == "percent" else 1.0
    if np.any(a < 0) or np.any(a > unit):
        raise StatsInputError(f"accuracies in {scale} must lie in [0, {unit:g}]; got {a.min():g} to {a.max():g}.")
    t = np.broadcast_to(np.asarray(n), a.shape)
    _, t = check_counts(np.zeros(a.shape, dtype=np.int64), t)
    c = np.rint(a / unit * t).astype(np.int64)
    dec = np.array([_decimals(x) for x in a])
    off = np.abs(c / t * unit - a) > 0.5 * 10.0**-dec + 1e-9 * unit
    if np.any(off):
        i = int(np.flatnonzero(off)[0])
        raise StatsInputError(
            f"accuracy[{i}] = {a[i]:g} is not k/{t[i]} for any whole k at its printed precision "
            f"(nearest {c[i]}/{t[i]} = {c[i] / t[i] * unit:.6g}); check n, or pass counts."
        )
    sign = "%" if scale == "percent" else "fractions"
    per = f"n = {int(t[0])}" if np.all(t == t[0]) else "the given n"
    note = f"accuracies in {sign} with {per} per residue, rounded to whole counts (every printed value reproduced)"
    return c, np.array(t), note


# ---- gate cycling ---------------------------------------------------------------------------------------


def _r2(obs: np.ndarray, pred: np.ndarray) -> float:
    """Squared Pearson correlation (NaN when either side is constant)."""
    if np.ptp(obs) == 0 or np.ptp(pred) == 0:
        return float("nan")
    return float(np.corrcoef(obs, pred)[0, 1] ** 2)


def _plain_r2(obs: np.ndarray, pred: np.ndarray) -> float:
    """1 − SS_res / SS_tot against the identity line."""
    ss_tot = float(((obs - obs.mean()) ** 2).sum())
    return 1.0 - float(((obs - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")


@dataclass(frozen=True, repr=False, eq=False)
class GateCyclingSummary:
    """Result of :func:`gate_cycling_summary`.

    Attributes:
        stride: S.
        clean: ``(S,)`` clean accuracy per phase.
        predicted: shift → ``(S,)`` prediction, the clean profile rolled by δ (A_δ(r) = A_0((r − δ) mod S)).
        frame: one row per shift with the paper's quantities (see :func:`gate_cycling_summary`).
    """

    stride: int
    clean: np.ndarray
    predicted: Mapping[int, np.ndarray]
    frame: pd.DataFrame

    def __post_init__(self) -> None:
        readonly(self.clean, *self.predicted.values())

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def __repr__(self) -> str:
        f = self.frame
        return (
            f"GateCyclingSummary(stride {self.stride}, shifts {f['shift'].tolist()}: R² without the last phase "
            f"{f['r2_excl_last'].min():.3f}-{f['r2_excl_last'].max():.3f}, interior "
            f"{f['r2_interior'].min():.3f}-{f['r2_interior'].max():.3f}, all "
            f"{f['r2_all'].min():.3f}-{f['r2_all'].max():.3f})"
        )


def gate_cycling_summary(clean: ArrayLike, observed: Mapping[int, ArrayLike]) -> GateCyclingSummary:
    """The paper's gate-cycling summary from a clean per-phase profile and the profile under each shift.

    For a shift δ the prediction is ``np.roll(clean, δ)``. Its boundary phases are the two weak spots that can
    break the prediction: S − 1 (where the window still ends) and (S − 1 + δ) mod S (where the rolled gates put
    it). Per shift, in the input's units:

    * ``r2_excl_last``, ``r2_interior``, ``r2_all``: squared Pearson correlation between the observed change
      ``observed − clean`` and the predicted change ``predicted − clean``, over the phases other than S − 1,
      the phases other than both boundary phases, and all phases. This is the definition that reproduces the
      paper's published R² (tests/stats/test_published.py); it is not 1 − SS_res/SS_tot of the levels.
    * ``mae_all``, ``mae_interior``: mean |observed − predicted| over all and over the interior phases.
    * ``acc_change``: mean(observed) − mean(clean); ``accuracy``: mean(observed).
    * ``plain_r2_excl_last``: 1 − SS_res/SS_tot of the levels without phase S − 1, for comparison.

    Args:
        clean: ``(S,)`` clean accuracy per phase.
        observed: δ → ``(S,)`` accuracy per phase with the gates rolled by δ (δ ≢ 0 mod S).

    Example:
        >>> s = gate_cycling_summary([50, 80, 70, 20], {1: [18, 52, 79, 71]})
        >>> s.predicted[1].tolist(), s.frame.loc[0, "boundary"], float(s.frame.loc[0, "mae_all"])
        ([20.0, 50.0, 80.0, 70.0], (0, 3), 1.5)
    """
    base = np.asarray(clean, dtype=np.float64)
    if base.ndim != 1 or base.size < 2 or not np.all(np.isfinite(base)):
        raise StatsInputError(f"clean must be a finite 1-D per-phase profile (S >= 2), got shape {base.shape}.")
    s = base.size
    if not observed:
        raise StatsInputError("observed is empty; pass {shift: per-phase accuracy} for at least one shift.")
    rows, predicted = [], {}
    for delta, obs_in in observed.items():
        obs = np.asarray(obs_in, dtype=np.float64)
        if obs.shape != (s,) or not np.all(np.isfinite(obs)):
            raise StatsInputError(f"observed[{delta}] must be {s} finite per-phase values, got shape {obs.shape}.")
        if int(delta) % s == 0:
            raise StatsInputError(f"shift {delta} is a multiple of S = {s}: nothing moves; drop it.")
        pred = np.roll(base, int(delta))
        predicted[int(delta)] = pred
        boundary = tuple(sorted({(s - 1 + int(delta)) % s, s - 1}))
        last = np.arange(s) != s - 1
        interior = ~np.isin(np.arange(s), boundary)
        d_obs, d_pred = obs - base, pred - base
        rows.append(
            dict(
                shift=int(delta),
                boundary=boundary,
                r2_excl_last=_r2(d_obs[last], d_pred[last]),
                r2_interior=_r2(d_obs[interior], d_pred[interior]),
                r2_all=_r2(d_obs, d_pred),
                mae_all=float(np.abs(obs - pred).mean()),
                mae_interior=float(np.abs(obs - pred)[interior].mean()),
                acc_change=float(obs.mean() - base.mean()),
                accuracy=float(obs.mean()),
                plain_r2_excl_last=_plain_r2(obs[last], pred[last]),
            )
        )
    return GateCyclingSummary(s, base, predicted, pd.DataFrame(rows))


# ---- knockout matrices ----------------------------------------------------------------------------------

KINDS = ("none", "selective", "partial", "global")


@dataclass(frozen=True, repr=False, eq=False)
class KnockoutSummary:
    """Result of :func:`knockout_summary`.

    Attributes:
        stride, modulus: S and M.
        threshold: relative change (%) at or below which a phase counts as hurt.
        phase_change: ``(L, S)`` mean relative change per phase (residues folded mod S).
        frame: one row per knockout (layer/head): worst residue and change, hurt phases, kind.
    """

    stride: int
    modulus: int
    threshold: float
    phase_change: np.ndarray
    frame: pd.DataFrame

    def __post_init__(self) -> None:
        readonly(self.phase_change)

    def selective(self) -> pd.DataFrame:
        """The knockouts that hurt only one or two phases."""
        return self.frame[self.frame["kind"] == "selective"]

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def __repr__(self) -> str:
        counts = self.frame["kind"].value_counts()
        sel = self.selective()["worst_phase_change"]
        span = f"; selective worst {sel.max():.1f} to {sel.min():.1f}%" if len(sel) else ""
        kinds = ", ".join(f"{k} {int(counts.get(k, 0))}" for k in KINDS)
        return f"KnockoutSummary(stride {self.stride}, threshold {self.threshold:g}%: {kinds}{span})"


def knockout_summary(
    relative_change: ArrayLike, stride: int, *, threshold: float = -50.0, max_selective: int | None = None
) -> KnockoutSummary:
    """Summarise a knockout × residue matrix of relative accuracy changes (%), ``100 (KO − clean) / clean``.

    Residues fold mod S by averaging the relative changes of the residues of a phase (the paper's folding: it
    reproduces the published per-phase matrix to its printed digit up to input rounding). A phase is hurt when
    its change is at or below ``threshold``. Each knockout is ``"none"`` (no phase hurt), ``"selective"`` (1 to
    ``max_selective`` phases), ``"global"`` (every phase) or ``"partial"`` (in between).

    Args:
        relative_change: ``(L, M)`` relative change in % per knockout (row) and residue (column).
        stride: S (divides M).
        threshold: hurt-phase threshold in %.
        max_selective: most phases a selective knockout may hurt; default min(2, S − 1).

    Example:
        >>> rel = [[-92, -90, -95, -91, -93, -94], [1, -97, 0, 2, -96, 1], [2, 0, -20, 1, 0, -30]]
        >>> k = knockout_summary(rel, 3)
        >>> k.frame["kind"].tolist(), k.frame["hurt_phases"].tolist()
        (['global', 'selective', 'none'], [(0, 1, 2), (1,), ()])
    """
    rel = np.asarray(relative_change, dtype=np.float64)
    if rel.ndim != 2 or rel.size == 0 or not np.all(np.isfinite(rel)):
        raise StatsInputError(f"relative_change must be a finite 2-D [knockouts, residues] matrix, got {rel.shape}.")
    stride, m = check_stride(stride, rel.shape[1])
    if max_selective is None:
        max_selective = min(2, stride - 1)
    if not 1 <= max_selective < stride:
        raise StatsInputError(f"max_selective must lie in 1..{stride - 1} for stride {stride}.")
    phase = rel.reshape(rel.shape[0], m // stride, stride).mean(axis=1)
    hurt = phase <= threshold
    n_hurt = hurt.sum(axis=1)
    kind = np.select([n_hurt == 0, n_hurt <= max_selective, n_hurt == stride], ["none", "selective", "global"],
                     "partial")
    frame = pd.DataFrame(
        {
            "knockout": np.arange(rel.shape[0]),
            "worst_residue": rel.argmin(axis=1),
            "worst_residue_change": rel.min(axis=1),
            "worst_phase": phase.argmin(axis=1),
            "worst_phase_change": phase.min(axis=1),
            "phase_spread": np.ptp(phase, axis=1),
            "hurt_phases": [tuple(np.flatnonzero(h).tolist()) for h in hurt],
            "kind": kind,
        }
    )
    return KnockoutSummary(stride, m, float(threshold), phase, frame)

