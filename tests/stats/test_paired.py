"""Paired designs decide with paired tests: Cochran's Q, the nested Cochran test, Friedman for the NLL.

Fast seeded versions of docs/statistics.md's size and power table: 256 items answered at all 8 residues,
item SD 1.5 logits, S = 4.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from phaselens import stats
from phaselens.stats.omnibus import g_statistic
from phaselens.stats.paired import stratified_q
from phaselens.stats.periodicity import nested_fold_statistic
from phaselens.stats.simulate import paired_tables

S, M, ITEMS, SD = 4, 8, 256, 1.5


def _rejections(x: np.ndarray) -> dict[str, float]:
    c = x.sum(axis=1)
    n = np.full_like(c, ITEMS)
    q_all, _ = stratified_q(x, 1)
    q_nest, informative = stratified_q(x, S)
    df_nest = np.maximum(informative.sum(axis=-1) * (M // S - 1), 1)
    return {
        "g": float(np.mean(sps.chi2.sf(g_statistic(c, n), M - 1) < 0.05)),
        "nested_g": float(np.mean(sps.chi2.sf(nested_fold_statistic(c, n, S), M - S) < 0.05)),
        "cochran": float(np.mean(sps.chi2.sf(q_all[:, 0], M - 1) < 0.05)),
        "nested_cochran": float(np.mean(sps.chi2.sf(q_nest.sum(axis=-1), df_nest) < 0.05)),
    }


def test_paired_tests_hold_their_size_where_count_tests_do_not() -> None:
    x = paired_tables(np.full(M, 0.6), ITEMS, SD, 600, np.random.default_rng(11))
    r = _rejections(x)
    # 5% ± 3 MC standard errors (0.9 pp each with 600 tables).
    assert 0.023 <= r["cochran"] <= 0.077 and 0.023 <= r["nested_cochran"] <= 0.077, r
    # Totals of correlated items have less variance than binomials: the count tests lose their size.
    assert r["g"] < 0.02 and r["nested_g"] < 0.02, r


def test_cochran_has_the_power_g_lacks_on_a_7pp_dip() -> None:
    x = paired_tables(np.tile([0.6, 0.6, 0.6, 0.53], 2), ITEMS, SD, 400, np.random.default_rng(12))
    r = _rejections(x)
    assert r["cochran"] > r["g"] + 0.15, r
    assert r["nested_cochran"] < 0.09, r  # the dip is 4-periodic: the nested null holds


def test_nested_cochran_is_a_sum_of_mcnemar_tests() -> None:
    # Two residues per class: each class's Cochran Q is McNemar's (b − c)² / (b + c).
    x = np.random.default_rng(3).integers(0, 2, size=(60, 8))
    res = stats.nested_cochran_q(x, 4)
    b = ((x[:, :4] == 1) & (x[:, 4:] == 0)).sum(axis=0)
    c = ((x[:, :4] == 0) & (x[:, 4:] == 1)).sum(axis=0)
    assert res.statistic == pytest.approx(float(((b - c) ** 2 / (b + c)).sum()))
    assert res.df == 4 and res.pvalue == pytest.approx(sps.chi2.sf(res.statistic, 4))


def test_nested_cochran_matches_friedman_within_each_class() -> None:
    # Three residues per class: Cochran's Q equals scipy's Friedman (tie-corrected) on 0/1 data.
    x = np.random.default_rng(4).integers(0, 2, size=(80, 12))
    expected = sum(sps.friedmanchisquare(*x[:, p::4].T).statistic for p in range(4))
    assert stats.nested_cochran_q(x, 4).statistic == pytest.approx(expected, rel=1e-12)
    assert stats.nested_cochran_q(x, 1).statistic == pytest.approx(stats.cochran_q(x).statistic)


def _frame(x: np.ndarray, nll_shift: float = 0.0, seed: int = 0) -> pd.DataFrame:
    items, m = x.shape
    rng = np.random.default_rng(seed)
    item_effect = np.repeat(rng.normal(0, 1.0, items), m)
    res = np.tile(np.arange(m), items)
    nll = 1.0 + item_effect + nll_shift * (res % S == S - 1) + rng.normal(0, 0.3, items * m)
    return pd.DataFrame({"item_id": np.repeat(np.arange(items), m), "residue": res, "correct": x.ravel(),
                         "nll": nll})


def test_paired_battery_decides_with_paired_tests() -> None:
    x = paired_tables(np.tile([0.6, 0.75, 0.7, 0.35], 2), 200, SD, 1, np.random.default_rng(2))[0]
    r = stats.phase_battery_items(_frame(x, nll_shift=0.3), S, n_permutations=199, n_bootstrap=500)
    assert r.design == "paired"
    assert r.omnibus.name == "cochran_q" and r.omnibus is r.cochran
    assert r.nested.name == "nested_cochran_8_vs_4" and r.nested.pvalue > 0.05
    assert r.period.period == 4 and r.period.omnibus.name == "cochran_q"
    nll = r.metric("nll")
    assert nll.paired and nll.omnibus is nll.friedman and nll.friedman.pvalue < 1e-6
    assert "paired tests (these decide)" in repr(r) and "ignores the pairing" in repr(nll)


def test_unpaired_battery_decides_with_count_tests() -> None:
    x = paired_tables(np.tile([0.6, 0.75, 0.7, 0.35], 2), 200, SD, 1, np.random.default_rng(2))[0]
    frame = _frame(x).sample(frac=0.5, random_state=0)
    r = stats.phase_battery_items(frame, S, n_permutations=99, n_bootstrap=0)
    assert r.design == "unpaired" and r.cochran is None
    assert r.omnibus is r.counts.g and r.nested is r.counts.nested and r.period is r.counts.period
    nll = r.metric("nll")
    assert not nll.paired and nll.omnibus is nll.kruskal


def test_paired_stride_two_uses_wilcoxon() -> None:
    x = paired_tables(np.tile([0.6, 0.75], 4), 100, SD, 1, np.random.default_rng(6))[0]
    nll = stats.phase_battery_items(_frame(x, seed=1), 2, n_permutations=99, n_bootstrap=0).metric("nll")
    per_item = nll.wilcoxon
    assert nll.friedman is None and per_item is not None and nll.omnibus is per_item
    f = _frame(x, seed=1)
    means = f.assign(ph=f.residue % 2).pivot_table(index="item_id", columns="ph", values="nll").to_numpy()
    assert per_item.pvalue == pytest.approx(sps.wilcoxon(means[:, 0], means[:, 1]).pvalue)
