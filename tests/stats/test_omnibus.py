"""Omnibus tests: χ², G, Cochran's Q, generalized CMH, and their calibration under the null."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from phaselens import stats

FLASH = np.array([112, 178, 169, 76, 115, 179, 165, 84])


def test_batched_statistics_match_scipy_table_by_table() -> None:
    rng = np.random.default_rng(3)
    n = rng.integers(20, 300, size=(5, 6))
    c = rng.binomial(n, 0.4)
    chi = stats.chi2_statistic(c, n)
    g = stats.g_statistic(c, n)
    assert chi.shape == g.shape == (5,)
    for i in range(5):
        table = np.stack([c[i], n[i] - c[i]])
        assert chi[i] == pytest.approx(sps.chi2_contingency(table, correction=False).statistic, rel=1e-12)
        ref = sps.chi2_contingency(table, correction=False, lambda_="log-likelihood").statistic
        assert g[i] == pytest.approx(ref, rel=1e-12)


def test_g_test_on_flash() -> None:
    res = stats.g_test(FLASH, 256)
    assert res.name == "g" and res.df == 7
    assert res.statistic == pytest.approx(205.676, abs=1e-3)
    assert res.pvalue < 1e-39


def test_degenerate_tables_have_no_evidence() -> None:
    for c in ([256] * 8, [0] * 8):
        assert stats.chi2_test(c, 256).pvalue == 1.0
        assert stats.g_test(c, 256).statistic == 0.0
    # A batch mixing a degenerate table with a live one: (0, 3) of 256 each gives
    # 2 · 1.5²/1.5 + 2 · 1.5²/254.5 = 3 + 4.5/254.5.
    batch = stats.chi2_statistic([[256, 256], [0, 3]], [256, 256])
    assert batch.tolist() == [0.0, pytest.approx(3 + 4.5 / 254.5, rel=1e-12)]


def test_empty_cells_in_g() -> None:
    # One residue all right, one all wrong: G = 2 * [10 ln 2 + 10 ln 2] * 2 = 40 ln 2.
    assert float(stats.g_statistic([10, 0], 10)) == pytest.approx(40 * np.log(2))


def _cochran_textbook(x: np.ndarray) -> float:
    # The mean-deviation form: Q = k (k − 1) Σ_j (C_j − C̄)² / (k N − Σ_i R_i²).
    k = x.shape[1]
    col, row = x.sum(0), x.sum(1)
    return k * (k - 1) * ((col - col.mean()) ** 2).sum() / (k * x.sum() - (row**2).sum())


def test_cochran_q_hand_example() -> None:
    x = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    # C = (4, 2, 1), R = (2, 1, 3, 1), N = 7: Q = 2 (3·21 − 49) / (21 − 15) = 14/3.
    res = stats.cochran_q(x)
    assert res.statistic == pytest.approx(14 / 3)
    assert res.df == 2
    assert res.pvalue == pytest.approx(np.exp(-7 / 3))  # χ²₂ survival is exp(−q/2)


def test_cochran_q_equals_friedman_on_binary_data() -> None:
    rng = np.random.default_rng(11)
    x = (rng.random((60, 8)) < np.linspace(0.3, 0.7, 8)).astype(int)
    res = stats.cochran_q(x)
    fr = sps.friedmanchisquare(*x.T)
    assert res.statistic == pytest.approx(fr.statistic, rel=1e-10)
    assert res.pvalue == pytest.approx(fr.pvalue, rel=1e-8)
    assert res.statistic == pytest.approx(_cochran_textbook(x), rel=1e-12)
    assert res.pvalue < 0.05  # a planted 40 pp trend over 60 items is detected


def test_cochran_q_ignores_uninformative_items() -> None:
    x = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0]])
    padded = np.vstack([x, np.ones((5, 3), int), np.zeros((5, 3), int)])
    assert stats.cochran_q(padded).statistic == pytest.approx(stats.cochran_q(x).statistic)
    assert stats.cochran_q(np.ones((4, 3))).pvalue == 1.0


def test_cmh_single_stratum_is_scaled_pearson() -> None:
    n = np.array([256, 200, 256, 180, 256, 256, 230, 256])
    table = np.stack([FLASH, n - FLASH])
    res = stats.cmh_test(table[None])
    big = n.sum()
    pearson = sps.chi2_contingency(table, correction=False).statistic
    assert res.statistic == pytest.approx((big - 1) / big * pearson, rel=1e-10)
    assert res.df == 7


def test_cmh_two_by_two_is_mantel_haenszel() -> None:
    tables = np.array([[[12, 5], [8, 15]], [[20, 10], [9, 14]], [[3, 7], [2, 9]]])
    num, var = 0.0, 0.0
    for t in tables:  # the classic 2 × 2 × K form, without continuity correction
        big = t.sum()
        r1, r2, c1, c2 = t[0].sum(), t[1].sum(), t[:, 0].sum(), t[:, 1].sum()
        num += t[0, 0] - r1 * c1 / big
        var += r1 * r2 * c1 * c2 / (big**2 * (big - 1))
    res = stats.cmh_test(tables)
    assert res.statistic == pytest.approx(num**2 / var, rel=1e-12)
    assert res.df == 1


def test_cmh_pools_strata_and_drops_tiny_ones() -> None:
    a = np.stack([FLASH, 256 - FLASH])
    tiny = np.zeros_like(a)
    tiny[0, 0] = 1  # one observation: no conditional variance, contributes nothing
    assert stats.cmh_test(np.stack([a, tiny])).statistic == pytest.approx(stats.cmh_test(a[None]).statistic)
    # Opposite effects in two strata cancel: the second stratum swaps right and wrong at every residue.
    both = stats.cmh_test(np.stack([a, a[::-1]]))
    assert both.statistic == pytest.approx(0.0, abs=1e-9)
    assert both.pvalue == pytest.approx(1.0)
    # An empty residue in every stratum lowers the rank, and with it the df.
    c = a.copy()
    c[:, 7] = 0
    assert stats.cmh_test(c[None]).df == 6


def test_null_calibration_of_chi2_and_nested_tests() -> None:
    # No phase effect: p = 0.6 at every residue, n = 256, M = 8, S = 4; 2,000 tables at once.
    rng = np.random.default_rng(2024)
    c = rng.binomial(256, 0.6, size=(2000, 8))
    chi_p = sps.chi2.sf(stats.chi2_statistic(c, 256), 7)
    g_p = sps.chi2.sf(stats.g_statistic(c, 256), 7)
    nested_p = sps.chi2.sf(stats.nested_fold_statistic(c, 256, 4), 4)
    for p in (chi_p, g_p, nested_p):
        assert abs((p < 0.05).mean() - 0.05) <= 0.02
        assert abs(p.mean() - 0.5) < 0.03


def test_power_against_a_planted_effect() -> None:
    rng = np.random.default_rng(5)
    acc = np.tile([0.55, 0.65, 0.65, 0.45], 2)
    c = rng.binomial(256, acc, size=(500, 8))
    assert (sps.chi2.sf(stats.chi2_statistic(c, 256), 7) < 0.05).mean() > 0.95
    # The effect is 4-periodic, so mod 8 vs mod 4 still holds its level.
    assert (sps.chi2.sf(stats.nested_fold_statistic(c, 256, 4), 4) < 0.05).mean() < 0.09
