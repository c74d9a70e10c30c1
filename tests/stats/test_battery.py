"""The two entry points: phase_battery (counts) and phase_battery_items (per-item frame)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from phaselens import stats

FLASH = np.array([112, 178, 169, 76, 115, 179, 165, 84])
V41 = np.array([2432, 2284, 2435, 2296, 2424, 2312, 2440, 2297])


@pytest.fixture(scope="module")
def flash() -> stats.PhaseBattery:
    return stats.phase_battery(FLASH, 256, stride=4, n_permutations=999, n_bootstrap=500, seed=0)


def test_battery_fields(flash: stats.PhaseBattery) -> None:
    assert (flash.stride, flash.modulus) == (4, 8)
    assert flash.phase_correct.tolist() == [227, 357, 334, 160]
    assert flash.phase_n.tolist() == [512] * 4
    assert (flash.worst_phase, flash.best_phase) == (3, 1)
    assert flash.phase_gap == pytest.approx((357 - 160) / 512)
    assert flash.residue_gap == pytest.approx((179 - 76) / 256)
    assert flash.nested.name == "nested_fold_8_vs_4" and not flash.nested.rejects(0.05)
    lo, hi = stats.wilson_ci(227, 512)
    assert (flash.phase_ci_low[0], flash.phase_ci_high[0]) == pytest.approx((lo, hi))
    assert np.all(flash.ci_low <= flash.accuracy) and np.all(flash.accuracy <= flash.ci_high)


def test_battery_matches_standalone_functions(flash: stats.PhaseBattery) -> None:
    h = stats.harmonic_fraction(FLASH, 256, 4, n_permutations=999, seed=0)
    g = stats.gap_permutation_test(FLASH, 256, 4, n_permutations=999, seed=0)
    ci = stats.gap_ci(FLASH, 256, 4, n_draws=stats.gapci.MIN_DRAWS, seed=0)
    assert (flash.harmonic.fraction, flash.harmonic.pvalue) == (h.fraction, h.pvalue)
    assert (flash.gap_test.pvalue, flash.gap_test.null_mean) == (g.pvalue, g.null_mean)
    assert flash.gap_ci is not None and (flash.gap_ci.ci_low, flash.gap_ci.ci_high) == (ci.ci_low, ci.ci_high)


def test_battery_is_frozen_and_deterministic(flash: stats.PhaseBattery) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        flash.stride = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        flash.accuracy[0] = 1.0
    again = stats.phase_battery(FLASH, 256, stride=4, n_permutations=999, n_bootstrap=500, seed=0)
    assert again.to_frame().equals(flash.to_frame())


def test_battery_frames(flash: stats.PhaseBattery) -> None:
    frame = flash.to_frame()
    assert list(frame.columns) == [
        "section",
        "quantity",
        "index",
        "estimate",
        "ci_low",
        "ci_high",
        "statistic",
        "df",
        "pvalue",
    ]
    residue = frame[frame.section == "residue"]
    assert len(residue) == 8 and residue["ci_low"].iloc[0] == pytest.approx(0.37810, abs=1e-5)
    tests = frame[frame.section == "test"].set_index("quantity")
    assert tests.loc["chi2", "df"] == 7 and tests.loc["chi2", "statistic"] == pytest.approx(201.365, abs=1e-3)
    assert frame.loc[frame.quantity == "detected_period", "estimate"].item() == 4
    assert flash.phase_frame()["boundary"].tolist() == [False, False, False, True]
    assert flash.residue_frame()["phase"].tolist() == [0, 1, 2, 3] * 2


def test_battery_summary_is_readable(flash: stats.PhaseBattery) -> None:
    text = repr(flash)
    assert text == flash.summary()
    # The paper's worst / best / gap are per residue; the folded ones are labelled per phase.
    assert "per residue: worst 3 (29.69%), best 5 (69.92%), gap 40.23 pp" in text
    assert "per phase: worst 3 (31.25%), best 1 (69.73%), boundary 3 (31.25%), folded gap 38.48 pp" in text
    assert "chi2=201.36 (df 7) p=5.90e-40" in text
    assert "detected period: 4 (identified" in text


def test_battery_v41_with_per_residue_n() -> None:
    b = stats.phase_battery(V41, np.full(8, 2560), stride=2, n_permutations=199, n_bootstrap=0)
    assert round(100 * b.residue_gap, 2) == 6.09
    assert b.period.period == 2 and b.gap_ci is None
    assert b.worst_phase == 1 == b.stride - 1


def test_battery_on_flat_counts_reports_no_period() -> None:
    b = stats.phase_battery([150] * 8, 256, stride=4, n_permutations=199, n_bootstrap=100)
    assert b.period.period is None
    assert b.chi2.pvalue == pytest.approx(1.0) and b.gap_test.pvalue == 1.0
    assert np.isnan(b.harmonic.fraction) and np.isnan(b.harmonic.pvalue)
    assert "detected period: None" in b.summary()


def _item_frame(n_items: int, acc: np.ndarray, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    m = acc.size
    logit = np.log(acc / (1 - acc))[None, :] + rng.normal(0, 1.0, size=(n_items, 1))
    prob = 1 / (1 + np.exp(-logit))
    correct = rng.random((n_items, m)) < prob
    return pd.DataFrame(
        {
            "item_id": np.repeat([f"item{i}" for i in range(n_items)], m),
            "residue": np.tile(np.arange(m), n_items),
            "correct": correct.ravel(),
            "nll": (-np.log(np.where(correct, prob, 1 - prob))).ravel(),
        }
    )


def test_items_battery_paired() -> None:
    frame = _item_frame(150, np.tile([0.5, 0.75, 0.7, 0.3], 2), seed=0)
    r = stats.phase_battery_items(frame, 4, n_permutations=499, n_bootstrap=300)
    assert r.design == "paired" and r.pairing_note is None and r.n_items == 150
    assert r.cochran is not None and r.cochran.df == 7 and r.cochran.pvalue < 1e-10
    matrix = frame["correct"].to_numpy().reshape(150, 8).astype(int)
    assert r.cochran.statistic == pytest.approx(stats.cochran_q(matrix).statistic)
    assert r.within_item is not None and r.within_item.pvalue < 0.01
    assert r.gap_ci is not None and r.gap_ci.scheme == "item-cluster"
    assert r.gap_ci.ci_low < r.counts.phase_gap < r.gap_ci.ci_high
    assert r.counts.period.period == 4 and r.counts.gap_ci is None
    nll = r.metric("nll")
    assert [c.metric for c in r.continuous] == ["nll"]
    assert nll.friedman is not None and nll.friedman.pvalue < 1e-3 and nll.permutation.pvalue < 0.05
    assert r.counts.n.tolist() == [150] * 8
    assert int(r.counts.correct.sum()) == int(frame["correct"].sum())
    frame_out = r.to_frame()
    assert {"cochran_q", "kruskal", "friedman"} <= set(frame_out["quantity"])
    assert "Cochran's Q=" in repr(r) and "CI from items (item-cluster)" in repr(r)


def test_items_battery_unpaired_says_why() -> None:
    frame = _item_frame(100, np.full(8, 0.6), seed=1).sample(frac=0.6, random_state=0)
    r = stats.phase_battery_items(frame, 4, n_permutations=199, n_bootstrap=200)
    assert r.design == "unpaired"
    assert r.cochran is None and r.within_item is None
    assert r.cochran_skipped is not None and "lack some of the 8 residues" in r.cochran_skipped
    assert "Cochran's Q skipped: not paired" in r.summary()
    frame_out = r.to_frame()
    assert frame_out.loc[frame_out.quantity == "cochran_q", "note"].item() == r.cochran_skipped
    assert r.metric("nll").friedman is None
    with pytest.raises(KeyError, match="logit_diff"):
        r.metric("logit_diff")


def test_items_battery_duplicate_rows_are_not_paired() -> None:
    frame = _item_frame(20, np.full(4, 0.6), seed=2)
    frame = pd.concat([frame, frame.iloc[:1]], ignore_index=True)
    r = stats.phase_battery_items(frame, 4, n_permutations=99, n_bootstrap=0)
    assert r.cochran is None and "appears 2 times at residue 0" in r.cochran_skipped
    assert r.gap_ci is None
