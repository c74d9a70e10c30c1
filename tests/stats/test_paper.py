"""The paper's published numbers (arXiv 2609.36322), reproduced from the counts the package ships
(``phaselens.data.paper_counts()``, the one copy of ``niah_counts.json``)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from phaselens import stats
from phaselens.data import paper_counts

DATA = paper_counts()
FLASH = DATA["models"]["DeepSeek-V4-Flash-Base"]
V41 = DATA["models"]["DeepSeek-V4.1-Flash-0910"]
MODELS = {"flash": FLASH, "v41": V41}


def test_wilson_bounds_flash_residue_0() -> None:
    lo, hi = stats.wilson_ci(FLASH["correct"], FLASH["n_per_residue"])
    assert (
        [round(100 * lo[0], 2), round(100 * hi[0], 2)]
        == FLASH["published"]["wilson95_r0_pct"]
        == [37.81, 49.87]
    )
    ref = sps.binomtest(112, 256).proportion_ci(method="wilson")
    assert (lo[0], hi[0]) == pytest.approx((ref.low, ref.high), abs=1e-12)


@pytest.mark.parametrize("model", ["flash", "v41"])
def test_gap_across_residues(model: str) -> None:
    # The published "gap across residues" is max − min of the 8 unfolded per-residue accuracies:
    # Flash-Base 179/256 − 76/256 = 40.234 pp; V4.1 2440/2560 − 2284/2560 = 6.094 pp.
    m = MODELS[model]
    g = stats.residue_gap(m["correct"], m["n_per_residue"])
    assert round(100 * g, 2) == m["published"]["gap_pp"]


def test_flash_folded_gap_is_smaller_than_residue_gap() -> None:
    # Folding mod 4 sums counts one period apart, which averages the extremes: 357/512 − 160/512.
    assert round(100 * stats.folded_gap(FLASH["correct"], 256, 4), 2) == 38.48


def test_flash_chi2_omnibus() -> None:
    res = stats.chi2_test(FLASH["correct"], FLASH["n_per_residue"])
    assert round(res.statistic) == 201
    assert res.df == 7
    assert f"{res.pvalue:.0e}" == "6e-40"


@pytest.mark.parametrize("model", ["flash", "v41"])
def test_nested_fold_mod8_vs_stride_adds_nothing(model: str) -> None:
    m = MODELS[model]
    res = stats.nested_fold_test(m["correct"], m["n_per_residue"], m["stride"])
    # Paper: p = 0.50–0.96. Measured: Flash-Base 0.938 (mod 8 vs 4), V4.1 0.835 (mod 8 vs 2).
    assert 0.50 <= res.pvalue <= 0.96
    assert res.df == 8 - m["stride"]


def test_nested_fold_mod8_vs_mod4_for_v41() -> None:
    assert 0.50 <= stats.nested_fold_test(V41["correct"], 2560, 4).pvalue <= 0.96  # measured 0.730


def test_harmonic_fraction_matches_paper_range() -> None:
    # Paper: 0.986–0.996. Measured: Flash-Base 0.99650 (S=4), V4.1 0.98579 (S=2): the two ends of the range.
    f = stats.harmonic_fraction(FLASH["correct"], 256, 4, n_permutations=999)
    v = stats.harmonic_fraction(V41["correct"], 2560, 2, n_permutations=999)
    assert f.fraction > 0.98 and v.fraction > 0.98
    assert round(f.fraction, 3) == 0.996
    assert round(v.fraction, 3) == 0.986
    assert f.null_fraction == pytest.approx(3 / 7) and v.null_fraction == pytest.approx(1 / 7)
    assert f.pvalue < 0.01 and v.pvalue < 0.01


@pytest.mark.parametrize(("model", "period"), [("flash", 4), ("v41", 2)])
def test_detected_period(model: str, period: int) -> None:
    m = MODELS[model]
    res = stats.detect_period(m["correct"], m["n_per_residue"])
    assert res.period == period == m["stride"]
    assert res.omnibus.pvalue < 1e-30


def test_battery_on_flash_base() -> None:
    b = stats.phase_battery(FLASH["correct"], 256, stride=4, n_permutations=999, n_bootstrap=500)
    assert round(100 * b.residue_gap, 2) == 40.23
    assert b.period.period == 4
    assert b.worst_phase == 3 == b.stride - 1  # the boundary phase is the weak one
    assert b.boundary_accuracy == pytest.approx(160 / 512)
    assert b.mean_accuracy == pytest.approx(sum(FLASH["correct"]) / 2048)
    assert round(b.chi2.statistic) == 201
    assert b.gap_test.pvalue == pytest.approx(1 / 1000)
    assert b.gap_ci is not None and b.gap_ci.ci_low > 0.3


FP8 = DATA["fp8_probe"]


def test_fp8_probe_group_means() -> None:
    res = stats.group_means(
        np.c_[FP8["p_correct_8"], FP8["p_wrong_32"]],
        FP8["lengths"],
        FP8["stride"],
        groups=[{2, 3}, {0, 1}],
        names=["p8", "p32"],
    )
    pct = 100 * res.means
    # L mod 4 in {2, 3}: P(8) 91.5, P(32) 7.2. The per-length values give 7.26 for P(32), not the printed 7.2
    # (the paper truncated or used unrounded probabilities); 7.26 is still within ±0.1 pp of 7.2.
    assert pct[0, 0] == pytest.approx(91.5, abs=0.1)
    assert pct[0, 1] == pytest.approx(7.2, abs=0.1)
    assert round(pct[0, 1], 2) == 7.26
    # L mod 4 in {0, 1}: P(8) 26.4, P(32) 71.3.
    assert pct[1, 0] == pytest.approx(26.4, abs=0.1)
    assert pct[1, 1] == pytest.approx(71.3, abs=0.1)
    assert res.counts.tolist() == [8, 8]
    assert res.mean({2, 3}, "p8") == pytest.approx(FP8["published"]["mod4_in_2_3"]["p8"], abs=1e-3)


def test_the_counts_are_the_published_ones() -> None:
    assert FLASH["correct"] == [112, 178, 169, 76, 115, 179, 165, 84]
    assert V41["correct"] == [2432, 2284, 2435, 2296, 2424, 2312, 2440, 2297]


def test_the_packaged_counts_load_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no checkout around: importlib.resources finds the package copy
    assert paper_counts() == DATA
