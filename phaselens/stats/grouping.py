"""Means of a per-position metric grouped by sets of phases (the FP8 completion probe).

The probe measures P(answer) at every prompt length L; the paper reports its mean over lengths whose
phase L mod S falls in a set, e.g. {2, 3} against {0, 1}.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from phaselens.errors import ResidueError, StatsInputError
from phaselens.stats._checks import check_stride, readonly


@dataclass(frozen=True, repr=False, eq=False)
class GroupMeans:
    """Per-group means of one or more metrics.

    Attributes:
        groups: the phase sets, in the order given.
        names: metric names, one per column of ``means``.
        means: ``(G, K)`` mean of metric k over positions whose phase is in group g.
        counts: ``(G,)`` positions in each group.
        stride: S.
    """

    groups: tuple[frozenset[int], ...]
    names: tuple[str, ...]
    means: np.ndarray
    counts: np.ndarray
    stride: int

    def __post_init__(self) -> None:
        readonly(self.means, self.counts)

    def mean(self, group: Iterable[int], name: str | None = None) -> float:
        """The mean of metric ``name`` (default: the only one) over ``group``."""
        g = self.groups.index(frozenset(group))
        if name is None:
            if len(self.names) != 1:
                raise StatsInputError(f"several metrics {list(self.names)}; pass name=.")
            return float(self.means[g, 0])
        return float(self.means[g, self.names.index(name)])

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            [
                {
                    "phases": sorted(g),
                    "metric": name,
                    "n": int(self.counts[i]),
                    "mean": float(self.means[i, k]),
                }
                for i, g in enumerate(self.groups)
                for k, name in enumerate(self.names)
            ]
        )

    def __repr__(self) -> str:
        parts = "; ".join(
            f"{sorted(g)} (n={self.counts[i]}): "
            + ", ".join(f"{name}={self.means[i, k]:.4g}" for k, name in enumerate(self.names))
            for i, g in enumerate(self.groups)
        )
        return f"GroupMeans(mod {self.stride}: {parts})"


def group_means(
    values: ArrayLike | int | float,
    positions: ArrayLike | int | float,
    stride: int,
    groups: Sequence[Iterable[int]],
    *,
    names: Sequence[str] | None = None,
    origin: int = 0,
) -> GroupMeans:
    """Mean of ``values`` over positions whose phase ``(position − origin) mod stride`` lies in each group.

    Args:
        values: ``(N,)`` or ``(N, K)`` metric per position (K metrics side by side).
        positions: ``(N,)`` integer positions (e.g. prompt lengths L).
        stride: S.
        groups: disjoint, non-empty sets of phases in 0..S−1, e.g. ``[{2, 3}, {0, 1}]``.
        names: K metric names (default ``value`` or ``value0..``).
        origin: position of phase 0.

    Example:
        >>> p8 = [.101, .178, .787, .951, .361, .447, .906, .956]
        >>> group_means(p8, range(24, 32), 4, [{2, 3}, {0, 1}]).means[:, 0].round(4).tolist()
        [0.9, 0.2718]
    """
    stride, _ = check_stride(stride, stride)
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        v = v[:, None]
    if v.ndim != 2 or v.shape[0] == 0:
        raise StatsInputError(f"values must be (N,) or (N, K) with N >= 1, got shape {np.shape(values)}.")
    if not np.all(np.isfinite(v)):
        raise StatsInputError("values contain NaN or inf; drop those positions first.")
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu" or pos.shape != (v.shape[0],):
        raise StatsInputError(
            f"positions must be {v.shape[0]} integers (one per row of values), got {pos.dtype} {pos.shape}."
        )
    if names is None:
        names = ("value",) if v.shape[1] == 1 else tuple(f"value{k}" for k in range(v.shape[1]))
    if len(names) != v.shape[1]:
        raise StatsInputError(
            f"{len(names)} names for {v.shape[1]} metric columns; give one name per column."
        )
    sets = tuple(frozenset(int(p) for p in g) for g in groups)
    if not sets or any(not g for g in sets):
        raise StatsInputError(
            "groups must be a non-empty list of non-empty phase sets, e.g. [{2, 3}, {0, 1}]."
        )
    if any(p < 0 or p >= stride for g in sets for p in g):
        raise ResidueError(f"group phases must lie in 0..{stride - 1} for stride {stride}.")
    if sum(len(g) for g in sets) != len(frozenset().union(*sets)):
        raise StatsInputError("groups overlap; each phase may belong to one group only.")
    phase = (pos - origin) % stride
    member = np.stack([np.isin(phase, sorted(g)) for g in sets])  # (G, N)
    counts = member.sum(axis=1)
    if np.any(counts == 0):
        empty = sorted(sets[int(np.argmin(counts))])
        raise StatsInputError(f"no position has a phase in {empty}; check positions, stride and origin.")
    return GroupMeans(sets, tuple(names), (member @ v) / counts[:, None], counts, stride)
