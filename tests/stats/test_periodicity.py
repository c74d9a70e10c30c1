"""Nested fold test, harmonic-energy fraction and period detection."""

from __future__ import annotations

import numpy as np
import pytest

from phaselens import stats

FLASH = np.array([112, 178, 169, 76, 115, 179, 165, 84])


def _exact(acc: list[float], n: int = 256) -> np.ndarray:
    """Counts with no sampling noise: accuracy × n, rounded."""
    return np.rint(np.asarray(acc) * n).astype(int)


def test_nested_fold_is_difference_of_g_statistics() -> None:
    folded_c, folded_n = stats.fold_counts(FLASH, 256, 4)
    expected = stats.g_test(FLASH, 256).statistic - stats.g_test(folded_c, folded_n).statistic
    res = stats.nested_fold_test(FLASH, 256, 4)
    assert res.statistic == pytest.approx(expected, rel=1e-12)
    assert res.name == "nested_fold_8_vs_4" and res.df == 4
    assert res.statistic == pytest.approx(0.8003, abs=1e-4)


def test_nested_fold_edge_periods() -> None:
    full = stats.nested_fold_test(FLASH, 256, 8)
    assert (full.statistic, full.df, full.pvalue) == (0.0, 0, 1.0)
    one = stats.nested_fold_test(FLASH, 256, 1)  # folding to one column leaves the omnibus G
    assert one.statistic == pytest.approx(stats.g_test(FLASH, 256).statistic)
    assert one.df == 7


def test_nested_fold_rejects_when_the_period_is_too_short() -> None:
    res = stats.nested_fold_test(FLASH, 256, 2)
    assert res.pvalue < 1e-30  # phases 1 and 3 (mod 4) are 38 pp apart; mod 2 cannot hold that


def test_harmonic_fraction_of_pure_profiles() -> None:
    periodic = np.tile([0.2, 0.5, 0.9, 0.4], 2)
    assert float(stats.harmonic_statistic(periodic, 4)) == pytest.approx(1.0)
    # One residue out of line: its power spreads evenly over all 7 non-DC bins, 3 of which are periodic.
    spike = np.full(8, 0.5)
    spike[3] = 0.9
    assert float(stats.harmonic_statistic(spike, 4)) == pytest.approx(3 / 7)
    assert np.isnan(stats.harmonic_statistic(np.full(8, 0.5), 4))
    batch = stats.harmonic_statistic(np.stack([periodic, spike]), 4)
    assert batch.shape == (2,) and batch[0] == pytest.approx(1.0)


def test_harmonic_permutation_null_mean_equals_analytic_null() -> None:
    # Permuting residues keeps the non-DC power fixed (Parseval), so the permutation mean of the
    # fraction is exactly (S − 1)/(M − 1); 4,999 draws pin it to about ±0.005.
    rng = np.random.default_rng(9)
    c = rng.binomial(200, 0.5, size=12)
    for s in (2, 3, 4, 6):
        res = stats.harmonic_fraction(c, 200, s, n_permutations=4999, seed=s)
        assert res.null_fraction == pytest.approx((s - 1) / 11)
        assert res.null_mean == pytest.approx(res.null_fraction, abs=0.012)
        assert res.power.shape == (12,)


def test_harmonic_pvalue_detects_a_periodic_effect_only() -> None:
    planted = stats.harmonic_fraction(_exact(np.tile([0.5, 0.7, 0.7, 0.4], 2)), 256, 4, n_permutations=999)
    assert planted.fraction == pytest.approx(1.0) and planted.pvalue < 0.01
    spike = stats.harmonic_fraction(
        _exact([0.6, 0.6, 0.6, 0.2, 0.6, 0.6, 0.6, 0.6]), 256, 4, n_permutations=999
    )
    assert spike.fraction == pytest.approx(3 / 7) and spike.pvalue > 0.2


def test_detect_period_none_on_a_flat_table() -> None:
    res = stats.detect_period([150] * 8, 256)
    assert res.period is None and res.status == "no effect" and res.candidates == ()
    assert [t.name for t in res.nested] == ["nested_fold_8_vs_2", "nested_fold_8_vs_4"]
    # Sampling noise alone, seeded: still no period.
    noisy = np.random.default_rng(1).binomial(256, 0.6, size=8)
    assert stats.detect_period(noisy, 256).omnibus.pvalue > 0.05
    assert stats.detect_period(noisy, 256).period is None


@pytest.mark.parametrize(
    ("pattern", "modulus", "period"),
    [
        ([0.5, 0.7, 0.7, 0.3], 8, 4),
        ([0.5, 0.8], 8, 2),
        ([0.3, 0.7, 0.7], 12, 3),
        ([0.6, 0.4, 0.7, 0.3, 0.8, 0.2], 12, 6),
    ],
)
def test_detect_period_finds_the_planted_stride(pattern: list[float], modulus: int, period: int) -> None:
    c = _exact(np.tile(pattern, modulus // len(pattern)))
    res = stats.detect_period(c, 256)
    assert res.period == period and res.status == "identified" and res.candidates == (period,)
    tests = {int(t.name.rsplit("_", 1)[1]): t for t in res.nested}
    assert set(tests) == {d for d in range(2, modulus) if modulus % d == 0}
    # Closed testing: every divisor of the period is rejected; the period's own nested test is not.
    assert all(tests[d].rejects(0.05) for d in tests if period % d == 0 and d < period)
    assert period == modulus or not tests[period].rejects(0.05)


def test_detect_period_on_sampled_tables() -> None:
    rng = np.random.default_rng(7)
    acc = np.tile([0.44, 0.70, 0.65, 0.31], 2)
    found = [stats.detect_period(rng.binomial(256, acc), 256).period for _ in range(40)]
    assert found.count(4) >= 34  # the mod-4 step holds its 5% level; the rest must be 4


def test_detect_period_is_modulus_for_an_aperiodic_effect() -> None:
    c = _exact([0.6, 0.6, 0.6, 0.2, 0.6, 0.6, 0.6, 0.6])
    res = stats.detect_period(c, 256)
    assert res.period == 8
    assert [t.name for t in res.nested] == ["nested_fold_8_vs_2", "nested_fold_8_vs_4"]
    frame = res.to_frame()
    assert frame["candidate_period"].tolist()[1:] == [2, 4]
    assert frame["rejects"].tolist() == [True, True, True]
    assert res.checks[0][0] == 8 and res.checks[0][1] == 0.0  # no departure from 8-periodicity at M = 8


def test_period_result_repr() -> None:
    text = repr(stats.detect_period(FLASH, 256))
    assert text.startswith("PeriodResult(period=4") and "P=2" in text and "P=4: p=0.938" in text
