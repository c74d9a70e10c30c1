"""Property tests (hypothesis) for the building blocks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats as sps

from phaselens import stats


@st.composite
def count_and_n(draw: st.DrawFn) -> tuple[int, int]:
    n = draw(st.integers(1, 100_000))
    return draw(st.integers(0, n)), n


@settings(max_examples=200, deadline=None)
@given(count_and_n(), st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_wilson_contains_estimate_and_matches_scipy(kn: tuple[int, int], level: float) -> None:
    k, n = kn
    lo, hi = stats.wilson_ci(k, n, level)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    ref = sps.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    assert abs(lo - ref.low) < 1e-9 and abs(hi - ref.high) < 1e-9


@st.composite
def residue_table(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    period = draw(st.sampled_from([1, 2, 3, 4, 6]))
    m = period * draw(st.integers(1, 4))
    n = draw(hnp.arrays(np.int64, m, elements=st.integers(1, 500)))
    frac = draw(hnp.arrays(np.float64, m, elements=st.floats(0, 1)))
    return np.floor(frac * n).astype(np.int64), n, period


@settings(max_examples=150, deadline=None)
@given(residue_table())
def test_folding_keeps_every_trial(table: tuple[np.ndarray, np.ndarray, int]) -> None:
    c, n, period = table
    fc, fn = stats.fold_counts(c, n, period)
    assert fc.shape == fn.shape == (period,)
    assert fc.sum() == c.sum() and fn.sum() == n.sum()
    assert np.all(fc <= fn)
    # Folding is consistent with folding further: mod M → mod P → mod 1 is the grand total.
    assert stats.fold_counts(fc, fn, 1)[0].item() == c.sum()


@settings(max_examples=150, deadline=None)
@given(residue_table())
def test_nested_statistic_is_a_nonnegative_share_of_g(table: tuple[np.ndarray, np.ndarray, int]) -> None:
    c, n, period = table
    d = float(stats.nested_fold_statistic(c, n, period))
    g = float(stats.g_statistic(c, n))
    assert -1e-9 <= d <= g + 1e-9


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float64, 12, elements=st.floats(0, 1)), st.sampled_from([1, 2, 3, 4, 6, 12]))
def test_harmonic_fraction_is_a_fraction(acc: np.ndarray, stride: int) -> None:
    f = float(stats.harmonic_statistic(acc, stride))
    if np.ptp(acc) > 1e-6:
        assert -1e-12 <= f <= 1 + 1e-12
        # A common shift only moves the DC bin and a common scale cancels in the ratio.
        assert abs(float(stats.harmonic_statistic(acc * 0.5 + 0.2, stride)) - f) < 1e-9


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 30), elements=st.floats(0, 1)))
def test_adjusted_pvalues_are_monotone_and_bounded(p: np.ndarray) -> None:
    holm = stats.holm(p)
    bh = stats.benjamini_hochberg(p)
    assert np.all(holm >= p - 1e-15) and np.all(holm <= 1.0)
    assert np.all(bh >= p - 1e-15) and np.all(bh <= holm + 1e-12)
    order = np.argsort(p, kind="stable")
    assert np.all(np.diff(holm[order]) >= -1e-15)
    assert np.all(np.diff(bh[order]) >= -1e-15)
