"""Published figures analysed as they are published: accuracies with n, the gate-cycling arrays, knockout
matrices, and the 46 from-scratch series (tests/data, transcribed from the paper's figure data)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from phaselens import stats
from phaselens.errors import StatsInputError
from tests.support.paths import DATA

RUNS = json.loads((DATA / "from_scratch_runs.json").read_text())
CYC = json.loads((DATA / "gate_cycling_w12s12_1kv.json").read_text())["run"]
KO = json.loads((DATA / "knockout_relative_change.json").read_text())


# ---- accuracies with n ---------------------------------------------------------------------------------


def test_battery_accepts_published_percentages() -> None:
    s = RUNS["series"][0]  # W8/S8 1 KV seed 42, prefix padding
    b = stats.phase_battery(s["acc"], 1000, 8, n_permutations=99, n_bootstrap=0)
    assert b.correct.tolist() == [round(10 * a) for a in s["acc"]]
    assert b.input_note is not None and "n = 1000" in b.input_note and "input: accuracies in %" in repr(b)
    assert round(100 * b.mean_accuracy, 2) == s["published_mean"] == 50.56
    assert round(100 * b.residue_gap, 1) == s["published_gap"] == 75.3
    same = stats.phase_battery(np.array(s["acc"]) / 100, 1000, 8, n_permutations=99, n_bootstrap=0)
    assert same.correct.tolist() == b.correct.tolist()


def test_counts_stay_counts_and_scale_is_explicit() -> None:
    c, n, note = stats.counts_from_accuracy([68, 71, 77], 1000)
    assert c.tolist() == [68, 71, 77] and note is None  # whole numbers are counts unless told otherwise
    c, _, note = stats.counts_from_accuracy([68, 71, 77], 1000, scale="percent")
    assert c.tolist() == [680, 710, 770] and "%" in note


def test_accuracy_that_n_cannot_produce_raises() -> None:
    # 68.2% of 256 trials is 174.6: no whole count prints as 68.2.
    with pytest.raises(StatsInputError, match=r"accuracy\[0\] = 68.2 is not k/256"):
        stats.phase_battery([68.2, 71.5, 77.7, 44.6], 256, 4)
    with pytest.raises(StatsInputError, match="must lie in"):
        stats.counts_from_accuracy([0.5, 1.5], 100, scale="fraction")


def test_n_is_1000_per_residue() -> None:
    # The controls' published Wilson bounds (two decimals) come back exactly with n = 1000.
    full = RUNS["full_attention"][0]
    c, n, _ = stats.counts_from_accuracy(full["acc"], 1000)
    lo, hi = stats.wilson_ci(c, n)
    assert np.round(100 * lo, 2).tolist() == RUNS["full_attn_1kv_wilson95"]["lo"]
    assert np.round(100 * hi, 2).tolist() == RUNS["full_attn_1kv_wilson95"]["hi"]


# ---- the 46 from-scratch series ------------------------------------------------------------------------


def test_transcription_matches_the_published_means_and_gaps() -> None:
    series = RUNS["series"]
    assert len(series) == 46 and {s["S"] for s in series} == {4, 6, 8, 12}
    for s in series:
        a = np.array(s["acc"])
        assert a.size == 24 and round(float(np.ptp(a)), 1) == s["published_gap"], s["id"]
        assert abs(a.mean() - s["published_mean"]) <= 0.005 + 1e-9, s["id"]  # two sit on a rounding tie


def test_detector_returns_the_stride_on_every_published_series() -> None:
    for s in RUNS["series"]:
        r = stats.detect_period(*stats.counts_from_accuracy(s["acc"], 1000)[:2])
        assert r.period == s["S"] and r.status == "identified", (s["id"], s["padding"], r)
    for f in RUNS["full_attention"]:  # the controls: no effect at all
        assert stats.detect_period(*stats.counts_from_accuracy(f["acc"], 1000)[:2]).status == "no effect"


# ---- gate cycling --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cycling() -> stats.GateCyclingSummary:
    return stats.gate_cycling_summary(CYC["clean"]["acc"], {c["d"]: c["obs"] for c in CYC["conds"]})


def test_cycling_predictions_are_the_clean_profile_rolled(cycling: stats.GateCyclingSummary) -> None:
    for c in CYC["conds"]:
        assert cycling.predicted[c["d"]].tolist() == c["pred"]
        row = cycling.frame.set_index("shift").loc[c["d"]]
        assert list(row["boundary"]) == c["boundary"]


def _printed(value: float, published: float, digits: int) -> bool:
    """``value`` prints as ``published`` at ``digits`` decimals, counting an exact rounding tie either way."""
    half = 0.5 * 10.0**-digits
    return round(value, digits) == published or abs(abs(value - published) - half) < 1e-9


def test_cycling_mae_and_accuracy_change_to_the_printed_digit(cycling: stats.GateCyclingSummary) -> None:
    # The inputs are exact (2,000 trials per phase print as multiples of 0.05), so these are exact too; one
    # (δ = −1, interior MAE = 17.75 / 10 = 1.775) sits on a rounding tie and prints as 1.77.
    f = cycling.frame.set_index("shift")
    for c in CYC["conds"]:
        row = f.loc[c["d"]]
        assert _printed(row["mae_all"], c["maeA"][0], 2)
        assert _printed(row["mae_interior"], c["maeI"][0], 2)
        assert _printed(row["acc_change"], c["dAcc"][0], 2)
        assert _printed(row["accuracy"], c["accPct"], 2)


def test_published_r2_is_the_squared_correlation_of_the_changes(cycling: stats.GateCyclingSummary) -> None:
    # All 18 published R² (3 per shift) are the squared Pearson correlation between the observed change
    # (obs − clean) and the predicted change (pred − clean), to the printed digit.
    f = cycling.frame.set_index("shift")
    for c in CYC["conds"]:
        row = f.loc[c["d"]]
        assert round(row["r2_excl_last"], 3) == c["r2x"][0]
        assert round(row["r2_interior"], 3) == c["r2i"][0]
        assert round(row["r2_all"], 3) == c["r2a"][0]


def test_plain_r2_of_the_levels_does_not_reproduce_them(cycling: stats.GateCyclingSummary) -> None:
    plain = cycling.frame["plain_r2_excl_last"].round(3).tolist()
    published = [c["r2x"][0] for c in CYC["conds"]]
    assert all(p != q for p, q in zip(plain, published)) and min(plain) < 0.85


# ---- knockout matrices ---------------------------------------------------------------------------------


def test_knockout_fold_reproduces_the_published_phase_matrix() -> None:
    k = stats.knockout_summary(KO["w8s8_seed42"]["rel"], 8)
    diff = np.abs(np.round(k.phase_change, 1) - np.array(KO["w8s8_seed42_folded"]["rel"]))
    assert diff.max() <= 0.1 + 1e-9  # inputs are rounded to 0.1: the fold can move by one digit
    assert (diff < 1e-9).sum() >= 200  # and is exact in 208 of 224 cells


def test_compressed_knockouts_hurt_one_or_two_phases_by_56_to_99_percent() -> None:
    k = stats.knockout_summary(KO["w8s8_seed42"]["rel"], 8)
    sel = k.selective()
    assert sel["knockout"].tolist() == [9, 10, 11, 14, 15]
    assert sel["hurt_phases"].map(len).tolist() == [2, 2, 2, 2, 2]
    # The paper: "single layers or heads hurt one or two phases (−56% to −99%)".
    assert round(sel["worst_phase_change"].max()) == -56 and round(sel["worst_phase_change"].min()) == -99
    assert k.frame.loc[0, "kind"] == "global"


def test_full_attention_knockouts_hurt_all_phases_alike() -> None:
    k = stats.knockout_summary(KO["full_attention_1kv"]["rel"], 8)
    assert k.selective().empty
    assert k.frame.loc[k.frame["kind"] == "global", "knockout"].tolist() == [0, 9, 21]
    assert (k.frame.loc[[0, 9, 21], "phase_spread"] < 6).all()


def test_deepseek_flash_whole_layer_knockout_hits_the_boundary_phase() -> None:
    k = stats.knockout_summary(KO["deepseek_v4_flash_base"]["rel"], 4)
    sel = k.selective()
    assert sel["knockout"].tolist() == [22] and sel["hurt_phases"].tolist() == [(3,)]
    assert repr(k).startswith("KnockoutSummary(stride 4, threshold -50%: none 42, selective 1")
