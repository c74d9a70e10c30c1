"""Moment-matched placement of the target key: ``PositionDesign``.

A phase-controlled task puts the target key at a chosen residue ``r = (t_K - origin) mod M`` while the
query position stays fixed. If the target simply sat at ``base + r``, residue would be confounded with the
distance to the query. The design below makes the **mean and variance of t_K identical for every residue**:

1. draw a continuous ``Z ~ Uniform[mu - K*M/2, mu + K*M/2]`` (K whole cycles of M);
2. round it stochastically onto the lattice ``{x : (x - origin) = r (mod M)}``: with ``x_lo <= Z < x_hi =
   x_lo + M`` take ``x_lo`` with probability ``(x_hi - Z) / M``, else ``x_hi``.

Stochastic rounding is unbiased, so ``E[t_K] = mu``. The rounding adds ``M^2 f (1 - f)`` variance, where
``f = (Z - x_lo) / M`` is uniform on [0, 1) for every r because Z spans whole cycles; so the added variance is
``M^2 / 6`` for every residue and ``Var[t_K] = K^2 M^2 / 12 + M^2 / 6``. With K = 1 this is ``M^2 / 4``,
which is (up to 1/4 slot) the least any residue-matched design can reach: the residue whose lattice points sit
``M/2`` either side of ``mu`` cannot have a smaller variance with mean ``mu``.

The exact pmf uses rational arithmetic, so the equality of moments is exact, not approximate.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from phaselens.errors import ResidueError, TaskError


def _tent_integral(d: Fraction, m: int) -> Fraction:
    """∫_{-inf}^{d} max(0, 1 - |s|/m) ds: the mass of the rounding kernel below offset d."""
    if d <= -m:
        return Fraction(0)
    if d <= 0:
        return (d + m) ** 2 / (2 * m)
    if d <= m:
        return m - (m - d) ** 2 / (2 * m)
    return Fraction(m)


@dataclass(frozen=True)
class PositionDesign:
    """Where the target key may sit, residue by residue, with equal first two moments.

    Args:
        modulus: M, the residue period (a multiple of the model's stride).
        lowest: the smallest slot any residue can use. The union of supports is ``lowest .. highest``
            with ``highest = lowest + (K + 2) M - 2``.
        n_cycles: K >= 1, the width of Z in whole cycles of M. Larger K spreads targets further.
        origin: the slot where compression block 0 begins; residues count from it.
    """

    modulus: int
    lowest: int
    n_cycles: int = 1
    origin: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.modulus, int | np.integer) or self.modulus < 1:
            raise ResidueError(f"modulus must be a positive integer, got {self.modulus!r}.")
        if not isinstance(self.n_cycles, int | np.integer) or self.n_cycles < 1:
            raise TaskError(f"n_cycles must be an integer >= 1 (whole cycles of M), got {self.n_cycles!r}.")
        if self.lowest < self.origin:
            raise TaskError(
                f"the design's first slot {self.lowest} lies before the origin {self.origin}; "
                "targets must sit in compressed positions (lower the origin or lengthen the lead-in)."
            )

    # ---- geometry ----------------------------------------------------------------------------------
    @property
    def width(self) -> int:
        """``highest - lowest`` = (K + 2) M - 2."""
        return (self.n_cycles + 2) * self.modulus - 2

    @property
    def highest(self) -> int:
        return self.lowest + self.width

    @property
    def interval(self) -> tuple[Fraction, Fraction]:
        """The support ``[a, b]`` of the continuous Z; ``a - M = lowest - 1``."""
        a = Fraction(self.lowest - 1 + self.modulus)
        return a, a + self.n_cycles * self.modulus

    @property
    def mean(self) -> Fraction:
        """E[t_K], the same for every residue."""
        a, b = self.interval
        return (a + b) / 2

    @property
    def variance(self) -> Fraction:
        """Var[t_K] = K^2 M^2 / 12 + M^2 / 6, the same for every residue."""
        m = self.modulus
        return Fraction(self.n_cycles**2 * m * m, 12) + Fraction(m * m, 6)

    def _check_residue(self, residue: int) -> int:
        if not isinstance(residue, int | np.integer) or not 0 <= residue < self.modulus:
            raise ResidueError(f"residue must be an integer in 0..{self.modulus - 1}, got {residue!r}.")
        return int(residue)

    # ---- exact distribution ------------------------------------------------------------------------
    def exact_pmf(self, residue: int) -> list[tuple[int, Fraction]]:
        """``[(slot, probability), ...]`` for one residue, probabilities as exact fractions."""
        r = self._check_residue(residue)
        m = self.modulus
        a, b = self.interval
        first = self.lowest + (r - (self.lowest - self.origin)) % m
        out = []
        for x in range(first, self.highest + 1, m):
            p = (_tent_integral(b - x, m) - _tent_integral(a - x, m)) / (self.n_cycles * m)
            if p > 0:
                out.append((x, p))
        return out

    def pmf(self, residue: int) -> tuple[np.ndarray, np.ndarray]:
        """The design pmf of t_K at one residue: ``(support [n] int64, probabilities [n] float64)``."""
        pairs = self.exact_pmf(residue)
        return (np.array([x for x, _ in pairs], dtype=np.int64), np.array([float(p) for _, p in pairs]))

    def moments(self, residue: int) -> tuple[Fraction, Fraction]:
        """Exact ``(mean, variance)`` of t_K at one residue, computed from its pmf."""
        pairs = self.exact_pmf(residue)
        mean = sum((x * p for x, p in pairs), Fraction(0))
        var = sum(((x - mean) ** 2 * p for x, p in pairs), Fraction(0))
        return mean, var

    # ---- sampling ----------------------------------------------------------------------------------
    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Uniform draws ``(z [n], v [n])``: Z on its interval and the rounding coin on [0, 1)."""
        a, _ = self.interval
        z = float(a) + self.n_cycles * self.modulus * rng.random(n)
        return z, rng.random(n)

    def place(self, residues: np.ndarray, z: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Round each ``z`` onto its residue's lattice: slots ``[n]`` int64.

        Passing the same ``(z, v)`` for several residues (the paired design) keeps each marginal exact while
        moving one base item as little as possible between residues.
        """
        residues = np.asarray(residues, dtype=np.int64)
        if residues.size and (residues.min() < 0 or residues.max() >= self.modulus):
            raise ResidueError(f"residues must lie in 0..{self.modulus - 1}.")
        m = self.modulus
        base = self.origin + residues
        lo = base + m * np.floor((z - base) / m).astype(np.int64)
        take_hi = v >= (lo + m - z) / m
        return np.where(take_hi, lo + m, lo).astype(np.int64)

    def sample(self, residues: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Independent draws of t_K, one per entry of ``residues`` ``[n]``."""
        residues = np.asarray(residues, dtype=np.int64)
        z, v = self.draw(rng, residues.size)
        return self.place(residues, z, v)

    def __repr__(self) -> str:
        return (
            f"PositionDesign(M={self.modulus}, K={self.n_cycles}, slots {self.lowest}..{self.highest}, "
            f"mean {float(self.mean):g}, sd {float(self.variance) ** 0.5:.3g})"
        )
