"""The battery on a subset of residues: values against scipy and hand computations, test sizes and interval
coverage by seeded simulation, and the reasons given for the tests that need the whole cycle."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from phaselens import stats
from phaselens.errors import ResidueError, StatsInputError
from phaselens.stats.simulate import count_tables, paired_tables

RES = np.array([0, 1, 2, 3, 4, 6])  # phases 0, 1, 2, 3, 0, 2 (stride 4, modulus 8): two phases hold two residues
PHASE = RES % 4


def _g(c: np.ndarray, n: np.ndarray) -> float:
    table = np.stack([c, n - c])
    return float(sps.power_divergence(table, sps.contingency.expected_freq(table), lambda_="log-likelihood",
                                      axis=None).statistic)


def _cochran(x: np.ndarray) -> float:
    """Cochran's Q by its textbook formula (independent of phaselens.stats.omnibus)."""
    k = x.shape[1]
    col, row = x.sum(0), x.sum(1)
    total = x.sum()
    return float((k - 1) * (k * (col**2).sum() - total**2) / (k * total - (row**2).sum()))


def test_count_battery_on_a_subset_matches_scipy() -> None:
    c = np.array([30, 41, 44, 20, 33, 55])
    n = np.array([50, 50, 60, 50, 55, 60])
    b = stats.phase_battery(c, n, stride=4, modulus=8, residues=RES, n_permutations=999)
    assert b.residues.tolist() == RES.tolist() and not b.complete
    chi2 = sps.chi2_contingency(np.stack([c, n - c]), correction=False)
    assert b.chi2.statistic == pytest.approx(chi2.statistic) and b.chi2.df == 5
    assert b.g.statistic == pytest.approx(_g(c, n))
    pc = np.bincount(PHASE, weights=c, minlength=4)
    pn = np.bincount(PHASE, weights=n, minlength=4)
    # nested: residues tested against their phases, df = 6 residues - 4 phases
    assert b.nested.df == 2 and b.nested.statistic == pytest.approx(_g(c, n) - _g(pc, pn))
    assert b.nested.pvalue == pytest.approx(sps.chi2.sf(b.nested.statistic, 2))
    np.testing.assert_allclose(b.phase_accuracy, pc / pn)
    assert b.phase_gap == pytest.approx(np.ptp(pc / pn))
    assert b.gap_test.statistic == pytest.approx(b.phase_gap)
    assert (b.worst_residue, b.best_residue) == (3, 6)  # residue labels, not column indices
    assert b.harmonic is None and b.period is None
    assert set(b.skipped) == {"harmonic", "period"}
    assert "every residue of the cycle" in b.skipped["period"]
    assert b.residue_frame()["residue"].tolist() == RES.tolist()
    assert "not run: harmonic" in repr(b) and "tested: residues [0, 1, 2, 3, 4, 6] of 0..7" in repr(b)
    # the same counts given in another order give the same battery
    order = np.array([5, 0, 3, 1, 4, 2])
    again = stats.phase_battery(c[order], n[order], stride=4, modulus=8, residues=RES[order], n_permutations=999)
    assert again.to_frame().equals(b.to_frame())


def test_count_battery_subset_reasons() -> None:
    one_each = stats.phase_battery([30, 40, 44, 20], 50, stride=4, modulus=24, residues=[0, 1, 2, 3],
                                   n_permutations=199)
    assert one_each.nested is None and "two or more residues" in one_each.skipped["nested"]
    assert one_each.gap_test is not None and one_each.gap_ci is not None
    one_phase = stats.phase_battery([30, 40, 44], 50, stride=4, modulus=24, residues=[3, 7, 11],
                                    n_permutations=199)
    assert one_phase.gap_test is None and one_phase.gap_ci is None and "0 by definition" in one_phase.skipped["gap"]
    assert one_phase.nested is not None and one_phase.nested.df == 2  # three residues of one phase
    assert np.isnan(one_phase.phase_accuracy[:3]).all() and one_phase.boundary_accuracy == pytest.approx(114 / 150)
    assert one_phase.phase_frame()["phase"].tolist() == [3]
    no_boundary = stats.phase_battery([30, 40], 50, stride=4, modulus=8, residues=[0, 1], n_permutations=199)
    assert np.isnan(no_boundary.boundary_accuracy) and "boundary 3 not tested" in repr(no_boundary)
    single = stats.phase_battery([30], 50, stride=4, modulus=8, residues=[5], n_permutations=199)
    assert single.chi2 is None and "one residue" in single.skipped["omnibus"]
    with pytest.raises(ResidueError, match="repeat a residue"):
        stats.phase_battery([1, 2], 5, stride=2, modulus=4, residues=[1, 1])
    with pytest.raises(ResidueError, match="residues has 3 entries but correct has 2"):
        stats.phase_battery([1, 2], 5, stride=2, modulus=4, residues=[0, 1, 2])
    with pytest.raises(ResidueError, match="outside 0..3"):
        stats.phase_battery([1, 2], 5, stride=2, modulus=4, residues=[0, 4])


def test_complete_residues_give_the_complete_battery() -> None:
    c = [112, 178, 169, 76, 115, 179, 165, 84]
    full = stats.phase_battery(c, 256, stride=4, n_permutations=999)
    listed = stats.phase_battery(c, 256, stride=4, residues=list(range(8)), n_permutations=999)
    assert listed.complete and listed.to_frame().equals(full.to_frame()) and listed.skipped == {}


def test_subset_permutation_and_nested_tests_hold_their_size() -> None:
    """No phase effect, unequal residues per phase and unequal n: rejection rates at 5% stay near 5%."""
    rng = np.random.default_rng(11)
    n = np.array([40, 60, 50, 45, 55, 70])
    tables = rng.binomial(n, 0.7, size=(400, RES.size))
    p_gap = np.array([stats.gap_permutation_test(t, n, 4, n_permutations=199, seed=i, phases=PHASE).pvalue
                      for i, t in enumerate(tables)])
    p_nested = np.array([stats.phase_battery(t, n, stride=4, modulus=8, residues=RES, n_permutations=1,
                                             n_bootstrap=0).nested.pvalue for t in tables])
    se = np.sqrt(0.05 * 0.95 / 400)
    assert abs((p_gap < 0.05).mean() - 0.05) < 3 * se, (p_gap < 0.05).mean()
    assert abs((p_nested < 0.05).mean() - 0.05) < 3 * se, (p_nested < 0.05).mean()


def _paired_frame(matrix: np.ndarray, residues: np.ndarray) -> pd.DataFrame:
    items, k = matrix.shape
    return pd.DataFrame({"item_id": np.repeat(np.arange(items), k), "residue": np.tile(residues, items),
                         "correct": matrix.ravel()})


def test_subset_gap_interval_covers() -> None:
    """The folded gap's interval over the phases present covers the true gap at least at its level."""
    profile = np.array([0.55, 0.8, 0.9, 0.65, 0.55, 0.9])  # the true per-phase accuracy: 0.55, 0.8, 0.9, 0.65
    truth = 0.9 - 0.55
    tables = count_tables(profile, 40, 200, np.random.default_rng(5))
    hits, width = [], []
    for i, t in enumerate(tables):
        b = stats.phase_battery(t, 40, stride=4, modulus=8, residues=RES, n_permutations=1, n_bootstrap=1, seed=i)
        hits.append(b.gap_ci.ci_low <= truth <= b.gap_ci.ci_high)
        width.append(b.gap_ci.ci_high - b.gap_ci.ci_low)
    assert np.mean(hits) >= 0.93, np.mean(hits)  # nominal 95% (conservative by construction); 2 SE below is 0.92
    assert np.mean(width) < 0.4  # and informative: about 0.3 wide around a gap of 0.35


def test_subset_item_interval_covers_with_absent_phases() -> None:
    """Paired items over residues of phases 0-2 only (phase 3 absent): the item-cluster interval over the
    three phases present covers the true gap."""
    res = np.array([0, 1, 2, 4, 5])
    profile = np.array([0.5, 0.75, 0.85, 0.5, 0.75])
    tables = paired_tables(profile, 80, 1.5, 150, np.random.default_rng(21))
    hits = []
    for i, m in enumerate(tables):
        r = stats.phase_battery_items(_paired_frame(m.astype(int), res), 4, 8, residues=res, n_permutations=1,
                                      n_bootstrap=1, seed=i)
        assert r.design == "paired" and r.gap_ci.scheme == "item-cluster"
        hits.append(r.gap_ci.ci_low <= 0.35 <= r.gap_ci.ci_high)
    assert np.mean(hits) >= 0.92, np.mean(hits)  # nominal 95%; 150 tables: 2 SE below is 0.914


def test_item_battery_on_a_paired_subset() -> None:
    rng = np.random.default_rng(3)
    profile = np.array([0.6, 0.85, 0.9, 0.3, 0.65, 0.9])
    m = paired_tables(profile, 120, 1.5, 1, rng)[0].astype(int)
    frame = _paired_frame(m, RES)
    frame["nll"] = rng.normal(1 + m, 0.3).ravel()
    r = stats.phase_battery_items(frame, 4, 24, residues=RES, n_permutations=499, n_bootstrap=200)
    assert r.design == "paired" and r.counts.residues.tolist() == RES.tolist()
    assert r.cochran.statistic == pytest.approx(_cochran(m)) and r.cochran.df == 5
    # nested Cochran: Q within the classes that hold two residues ({0, 4} and {2, 6}), df 1 each
    expected = _cochran(m[:, [0, 4]]) + _cochran(m[:, [2, 5]])
    assert r.nested.statistic == pytest.approx(expected) and r.nested.df == 2
    assert r.omnibus is r.cochran and r.period is None and "period" in r.skipped
    assert r.within_item is not None and r.within_item.pvalue < 0.01
    assert r.within_item.statistic == pytest.approx(np.ptp(r.counts.phase_accuracy))
    assert r.gap_ci.scheme == "item-cluster" and r.gap_ci.ci_low < r.counts.phase_gap < r.gap_ci.ci_high
    nll = r.metric("nll")
    per_phase = np.stack([frame.nll.to_numpy().reshape(120, 6)[:, PHASE == p].mean(1) for p in range(4)], 1)
    assert nll.friedman.statistic == pytest.approx(sps.friedmanchisquare(*per_phase.T).statistic)
    out = r.to_frame()
    assert set(out.loc[out.section == "not run", "quantity"]) >= {"harmonic", "period"}
    assert "detected_period (decision)" not in set(out.quantity)


def test_within_item_test_holds_its_size_on_a_subset() -> None:
    rng = np.random.default_rng(8)
    tables = paired_tables(np.full(RES.size, 0.7), 60, 1.5, 300, rng)
    p = np.array([stats.within_item_permutation_test(t, 4, n_permutations=199, seed=i, phases=PHASE).pvalue
                  for i, t in enumerate(tables)])
    nested = np.array([stats.nested_cochran_q(t, 4, phases=PHASE).pvalue for t in tables])
    se = np.sqrt(0.05 * 0.95 / 300)
    assert abs((p < 0.05).mean() - 0.05) < 3 * se, (p < 0.05).mean()
    assert (nested < 0.05).mean() < 0.05 + 3 * se, (nested < 0.05).mean()


def test_item_table_subset_errors() -> None:
    frame = pd.DataFrame({"item_id": [0, 1, 2], "residue": [0, 2, 5], "correct": [1, 0, 1]})
    with pytest.raises(StatsInputError, match=r"residues \[1, 3, 4, 6, 7\] have no rows.*residues=\[0, 2, 5\]"):
        stats.phase_battery_items(frame, 4)
    with pytest.raises(StatsInputError, match=r"rows at residues \[5\], which residues=\[0, 2\] leaves out"):
        stats.phase_battery_items(frame, 4, 8, residues=[0, 2])
    with pytest.raises(StatsInputError, match=r"residues \[3\] have no rows; every residue listed needs items"):
        stats.phase_battery_items(frame, 4, 8, residues=[0, 2, 3, 5])
