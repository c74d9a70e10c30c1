"""specialization_map: engine equals full forwards, journal and resume, the index's definition."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from phaselens.models.compressed.engine import SuffixEngine
from tests.support.models import LAYOUTS, task_model


@pytest.fixture(scope="module")
def model():
    # fp64: the engine and full forwards sum in different orders, and in fp32 a near-tie of the answer's logit
    # could flip a correct flag on some CPU; in fp64 the two paths agree to ~1e-15, far below any margin
    return task_model(LAYOUTS["w8s4-deepseek"], init_std=0.5).double()


@pytest.fixture(scope="module")
def exact(model):
    return phaselens.specialization_map(model, n_per_residue=6, progress=False, engine="full", n_bootstrap=50)


def test_suffix_engine_map_equals_full_forward_map(model, exact):
    fast = phaselens.specialization_map(model, n_per_residue=6, progress=False, engine="suffix", n_bootstrap=50)
    assert fast.metadata["engine"] == "suffix" and exact.metadata["engine"] == "full"
    assert np.array_equal(fast.correct_ko, exact.correct_ko)
    # answer metrics are scored in fp32 (scoring.answer_metrics), so the fp64 logits agree there to fp32 rounding
    assert np.nanmax(np.abs(fast.effects.delta_logit_diff - exact.effects.delta_logit_diff)) <= 1e-6
    assert list(fast.cells["label"])[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L0KV0"]
    assert fast.values("head").shape == (2, 4, 8) and fast.values("layer").shape == (2, 8)


def test_map_resumes_after_interruption_with_identical_results(model, tmp_path, monkeypatch):
    journal = tmp_path / "map.npz"
    calls = {"n": 0}
    real = SuffixEngine.run

    def flaky(self, cells, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, cells, **kw)

    monkeypatch.setattr(SuffixEngine, "run", flaky)
    kw = dict(n_per_residue=6, progress=False, engine="suffix", n_bootstrap=50, rows_per_pass=96, journal=journal)
    with pytest.raises(KeyboardInterrupt):
        phaselens.specialization_map(model, **kw)
    assert journal.exists() and not journal.with_suffix(".json").exists()  # one file: the manifest is in its header
    monkeypatch.setattr(SuffixEngine, "run", real)
    resumed = phaselens.specialization_map(model, **kw)
    fresh = phaselens.specialization_map(model, **{**kw, "journal": None})
    assert np.array_equal(resumed.correct_ko, fresh.correct_ko)
    assert np.allclose(resumed.effects.delta_logit_diff, fresh.effects.delta_logit_diff, equal_nan=True)


def test_a_journal_of_another_map_is_refused(model, tmp_path):
    journal = tmp_path / "m.npz"
    phaselens.specialization_map(model, n_per_residue=2, progress=False, n_bootstrap=0, journal=journal)
    with pytest.raises(phaselens.errors.JournalError, match="holds a different computation"):
        phaselens.specialization_map(model, n_per_residue=3, progress=False, n_bootstrap=0, journal=journal)


def test_specialization_index_definition(exact):
    si = exact.specialization_index(n_bootstrap=50)
    ph = exact.per_phase("head")
    for row in si.itertuples():
        dmg = np.clip(-np.nan_to_num(ph[ph["label"] == row.label]["rel_change"].to_numpy()) / 100, 0, None)
        if dmg.sum() == 0:  # no damage: the index is undefined (NaN), never 0 or negative
            assert np.isnan(row.raw_index) and np.isnan(row.specialization) and np.isnan(row.ci_low)
            assert row.note == "no damage" and row.worst_phase == -1 and row.score == 0
            continue
        assert row.note == ""
        q = dmg / dmg.sum()
        ent = -(q[q > 0] * np.log(q[q > 0])).sum()
        assert row.raw_index == pytest.approx(1 - ent / np.log(4))
        assert row.specialization == pytest.approx((row.raw_index - row.null_mean) / (1 - row.null_mean))
        assert row.worst_damage == pytest.approx(dmg.max()) and row.score == pytest.approx(
            max(row.specialization, 0) * dmg.max())
    assert (si["note"] == "no damage").any()  # this map has undamaged heads, so the branch above ran
    assert list(si["score"]) == sorted(si["score"], reverse=True)  # ranked by score
    strict = exact.specialization_index(alpha=1e-12, n_bootstrap=0)
    assert not strict["significant"].any()


def test_top_heads_and_frames(exact):
    top = exact.top_heads(phase=0, k=3, by="delta_logit_diff")
    assert len(top) == 3 and (top["phase"] == 0).all()
    assert list(top["delta_logit_diff"]) == sorted(top["delta_logit_diff"])
    ph = exact.per_phase("head")
    assert top["delta_logit_diff"].iloc[0] == ph[ph["phase"] == 0]["delta_logit_diff"].min()
    frame = exact.to_frame()
    assert len(frame) == len(exact.cells) * 8
    assert exact.bh_mask().shape == (len(exact.cells), 8)
    assert "PhaseMap" in repr(exact)
