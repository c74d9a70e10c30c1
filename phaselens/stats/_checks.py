"""Input validation shared by the statistics modules.

Every check raises :class:`~phaselens.errors.StatsInputError`, or :class:`~phaselens.errors.ResidueError`
for stride/modulus/residue geometry, with a message that names the fix.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from phaselens.core.checks import as_probability
from phaselens.errors import ResidueError, StatsInputError


def _as_integer_array(x: ArrayLike | int | float, name: str) -> np.ndarray:
    """``x`` as int64, refusing non-integral floats, NaN and booleans mixed with counts."""
    arr = np.asarray(x)
    if arr.size == 0:
        raise StatsInputError(f"{name} is empty; pass at least one residue's counts.")
    if arr.dtype.kind == "b":
        return arr.astype(np.int64)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind != "f":
        raise StatsInputError(f"{name} must be numeric counts, got dtype {arr.dtype}; pass integers.")
    if not np.all(np.isfinite(arr)):
        raise StatsInputError(f"{name} contains NaN or inf; pass finite integer counts.")
    if not np.all(arr == np.round(arr)):
        raise StatsInputError(
            f"{name} must hold whole counts, got non-integers such as {arr[arr != np.round(arr)].flat[0]!r}; "
            "pass counts of correct answers, not accuracies."
        )
    return arr.astype(np.int64)


def check_counts(correct: ArrayLike | int | float, n: ArrayLike | int | float) -> tuple[np.ndarray, np.ndarray]:
    """Validate per-residue counts.

    Args:
        correct: ``(..., R)`` correct answers per residue.
        n: an int, or ``(..., R)`` (broadcastable) trials per residue.

    Returns:
        ``(correct, n)`` as int64 arrays of the same shape ``(..., R)``.
    """
    c = _as_integer_array(correct, "correct")
    if c.ndim == 0:
        raise StatsInputError(
            "correct must be an array of per-residue counts, got a scalar; wrap it in a list."
        )
    t = _as_integer_array(n, "n")
    if t.ndim > 0 and t.shape[-1] != c.shape[-1]:
        raise StatsInputError(
            f"correct has {c.shape[-1]} residues but n has {t.shape[-1]}; "
            "pass n as one int or as an array with one entry per residue."
        )
    try:
        c, t = np.broadcast_arrays(c, t)
    except ValueError:
        raise StatsInputError(
            f"correct has shape {c.shape} and n has shape {t.shape}, which do not broadcast; "
            "give n one entry per residue."
        ) from None
    checks = (
        (t < 1, t, "n[{r}] = {v} is below 1; every residue needs at least one trial."),
        (c < 0, c, "correct[{r}] = {v} is negative; counts must satisfy 0 <= correct <= n."),
        (
            c > t,
            c,
            "correct[{r}] = {v} exceeds n[{r}] = {m}; counts must satisfy 0 <= correct <= n "
            "(pass counts of correct answers, not of wrong ones or of all trials).",
        ),
    )
    for bad, shown, msg in checks:
        if np.any(bad):
            idx = tuple(np.argwhere(bad)[0])
            raise StatsInputError(msg.format(r=idx[-1], v=shown[idx], m=t[idx]))
    return np.array(c), np.array(t)


def check_stride(stride: int, modulus: int) -> tuple[int, int]:
    """Validate that ``modulus`` is a positive multiple of ``stride``; return both as ints."""
    for name, v in (("stride", stride), ("modulus", modulus)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ResidueError(f"{name} must be an int, got {v!r}.")
        if v < 1:
            raise ResidueError(f"{name} must be at least 1, got {v}.")
    stride, modulus = int(stride), int(modulus)
    if modulus % stride:
        hint = stride * max(1, round(modulus / stride))
        raise ResidueError(
            f"modulus {modulus} is not a multiple of stride {stride}; residues must fold onto phases, "
            f"so use a multiple such as {hint} (the LCM of the strides you compare)."
        )
    return stride, modulus


def check_period(period: int, modulus: int) -> int:
    """Validate that ``period`` divides ``modulus``."""
    if isinstance(period, bool) or not isinstance(period, int | np.integer) or period < 1:
        raise ResidueError(f"period must be a positive int, got {period!r}.")
    if modulus % int(period):
        divisors = [d for d in range(1, modulus + 1) if modulus % d == 0]
        raise ResidueError(f"period {period} does not divide modulus {modulus}; use one of {divisors}.")
    return int(period)


def check_residues(residues: ArrayLike | int | float, modulus: int) -> np.ndarray:
    """Validate integer residues in ``0..modulus-1``; return int64 ``(N,)``."""
    r = np.asarray(residues)
    if r.size == 0:
        raise StatsInputError("residues is empty; pass one residue per row.")
    if r.dtype.kind == "f" and np.all(np.isfinite(r)) and np.all(r == np.round(r)):
        r = r.astype(np.int64)
    if r.dtype.kind not in "iu":
        raise ResidueError(f"residues must be integers, got dtype {r.dtype}; cast them with astype(int).")
    r = r.astype(np.int64, copy=False).ravel()
    bad = (r < 0) | (r >= modulus)
    if np.any(bad):
        raise ResidueError(
            f"residue {int(r[bad][0])} is outside 0..{modulus - 1}; reduce positions mod {modulus} first "
            f"(residue = (t - origin) % {modulus}) or pass a larger modulus."
        )
    return r


def resolve_residues(residues: ArrayLike | int | float, stride: int, modulus: int | None) -> tuple[np.ndarray, int, int]:
    """Validate per-row residues with their stride and modulus.

    ``modulus`` defaults to ``max(residues) + 1`` rounded up to a multiple of ``stride``.

    Returns:
        ``(residues, stride, modulus)``: residues as int64 ``(N,)``, the others as ints.
    """
    r0 = np.asarray(residues)
    if modulus is None:
        if r0.size == 0 or r0.dtype.kind not in "iu":
            raise StatsInputError(
                f"residues must be a non-empty integer array (got {r0.size} values of dtype {r0.dtype}); "
                "cast them with astype(int), or pass modulus= explicitly."
            )
        stride, _ = check_stride(stride, stride)
        modulus = max(-(-(int(r0.max()) + 1) // stride) * stride, stride)
    stride, modulus = check_stride(stride, modulus)
    return check_residues(r0, modulus), stride, modulus


def check_alpha(alpha: float) -> float:
    return as_probability("alpha", alpha, error=StatsInputError)


def check_level(level: float) -> float:
    return as_probability("level", level, error=StatsInputError)


def check_draws(k: int, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise StatsInputError(f"{name} must be a positive int, got {k!r}; e.g. 9999.")
    return int(k)


def check_values(values: ArrayLike | int | float, name: str, length: int | None = None) -> np.ndarray:
    """Validate a finite 1-D float vector, optionally of a given length."""
    v = np.asarray(values)
    if v.dtype.kind not in "biuf":
        raise StatsInputError(f"{name} must be numeric, got dtype {v.dtype}.")
    v = v.astype(np.float64).ravel()
    if v.size == 0:
        raise StatsInputError(f"{name} is empty; pass one value per row.")
    if length is not None and v.size != length:
        raise StatsInputError(
            f"{name} has {v.size} values but residues has {length}; pass one value per row of each."
        )
    if not np.all(np.isfinite(v)):
        raise StatsInputError(f"{name} contains NaN or inf; drop or impute those rows first.")
    return v


def readonly(*arrays: np.ndarray) -> None:
    """Freeze arrays held by frozen result dataclasses, so 'frozen' also covers their contents."""
    for a in arrays:
        if isinstance(a, np.ndarray):
            a.setflags(write=False)


def item_codes(item_ids: ArrayLike | int | float, length: int) -> np.ndarray:
    """Dense integer codes ``(N,)`` for arbitrary item labels."""
    ids = np.asarray(item_ids).ravel()
    if ids.size != length:
        raise StatsInputError(f"item_ids has {ids.size} rows but residues has {length}; pass one id per row.")
    return np.unique(ids, return_inverse=True)[1].ravel()
