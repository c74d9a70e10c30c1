"""The moment-matched target design: exact pmfs, exact moments, and sampling that follows the pmf."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from phaselens.errors import ResidueError, TaskError
from phaselens.tasks import KVRecall, PositionDesign


@settings(max_examples=120, deadline=None)
@given(
    modulus=st.integers(1, 30),
    n_cycles=st.integers(1, 4),
    origin=st.integers(0, 7),
    extra=st.integers(0, 50),
)
def test_exact_moments_are_equal_across_residues(
    modulus: int, n_cycles: int, origin: int, extra: int
) -> None:
    d = PositionDesign(modulus=modulus, lowest=origin + extra, n_cycles=n_cycles, origin=origin)
    expected_var = Fraction(n_cycles**2 * modulus**2, 12) + Fraction(modulus**2, 6)
    for r in range(modulus):
        pairs = d.exact_pmf(r)
        assert sum(p for _, p in pairs) == 1
        assert all((x - origin) % modulus == r for x, _ in pairs)
        assert all(d.lowest <= x <= d.highest for x, _ in pairs)
        mean, var = d.moments(r)
        assert mean == d.mean and var == expected_var == d.variance
        # The float pmf gives the same moments to 1e-9.
        xs, ps = d.pmf(r)
        m = float(np.dot(xs, ps))
        assert m == pytest.approx(float(d.mean), abs=1e-9)
        assert float(np.dot((xs - m) ** 2, ps)) == pytest.approx(float(expected_var), abs=1e-9)
    # Every slot of lowest..highest is used by some residue (the support is as tight as claimed).
    used = {x for r in range(modulus) for x, _ in d.exact_pmf(r)}
    assert used == set(range(d.lowest, d.highest + 1))


def test_k1_variance_is_quarter_m_squared() -> None:
    # The least variance a residue-matched design can have is about M^2/4 (see design.py); K = 1 attains it.
    d = PositionDesign(modulus=24, lowest=50)
    assert d.variance == 144 and d.width == 70


def test_sampling_follows_the_pmf() -> None:
    d = PositionDesign(modulus=8, lowest=20, n_cycles=2, origin=3)
    rng = np.random.default_rng(5)
    for r in (0, 3, 7):
        xs, ps = d.pmf(r)
        draws = d.sample(np.full(20000, r), rng)
        assert np.all((draws - 3) % 8 == r)
        counts = np.array([(draws == x).sum() for x in xs])
        assert counts.sum() == draws.size  # nothing outside the support
        assert sps.chisquare(counts, ps * draws.size).pvalue > 1e-4


def test_shared_draws_keep_each_residues_marginal() -> None:
    # The paired design rounds one z per item onto every residue; each residue's marginal is still the pmf.
    d = PositionDesign(modulus=6, lowest=10)
    z, v = d.draw(np.random.default_rng(0), 30000)
    for r in range(6):
        placed = d.place(np.full(z.size, r), z, v)
        xs, ps = d.pmf(r)
        counts = np.array([(placed == x).sum() for x in xs])
        assert sps.chisquare(counts, ps * z.size).pvalue > 1e-4
        assert np.all(np.abs(placed - z) < 6)  # a base item moves less than one period between residues


def test_design_errors() -> None:
    d = PositionDesign(modulus=4, lowest=9)
    with pytest.raises(ResidueError):
        d.exact_pmf(4)
    with pytest.raises(ResidueError):
        d.place(np.array([5]), np.array([10.0]), np.array([0.5]))
    with pytest.raises(TaskError):
        PositionDesign(modulus=4, lowest=2, origin=3)
    with pytest.raises(TaskError):
        PositionDesign(modulus=4, lowest=9, n_cycles=0)


def test_task_exposes_the_exact_design_pmf() -> None:
    task = KVRecall()
    means = set()
    for r in range(task.modulus):
        xs, ps = task.design_pmf(r)
        means.add(round(float(np.dot(xs, ps)), 9))
        assert np.all(xs % task.modulus == r)
    assert len(means) == 1
