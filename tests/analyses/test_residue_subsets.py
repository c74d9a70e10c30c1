"""A subset of residues works everywhere (issue 12): ``evaluate(model, residues=[0, 1, 2, 3])`` runs the battery
over the residues present, and every analysis that takes ``residues`` summarises and plots only those."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from phaselens import stats
from phaselens.errors import NotApplicableError
from tests.support.models import task_model, tiny_task

FAST = dict(n_permutations=199, n_bootstrap=100)


@pytest.fixture(scope="module")
def model():
    return task_model()


def test_evaluate_on_a_subset_runs_the_battery_on_the_residues_present(model):
    """Issue 12's reproducer: this raised StatsInputError (every residue 0..M-1 needed rows)."""
    ev = phaselens.evaluate(model, residues=[0, 1, 2, 3], n_per_residue=6, progress=False, **FAST)
    assert ev.residues.tolist() == [0, 1, 2, 3] and ev.modulus == 8
    pr = ev.per_residue()
    assert pr["residue"].tolist() == [0, 1, 2, 3] and (pr["n"] == 6).all()
    correct = ev.items.groupby("residue")["correct"].sum().to_numpy()
    ref = stats.phase_battery(correct, 6, stride=4, modulus=8, residues=[0, 1, 2, 3], n_permutations=199,
                              n_bootstrap=0)
    c = ev.tests.counts
    assert c.correct.tolist() == correct.tolist() and c.g.statistic == pytest.approx(ref.g.statistic)
    assert c.gap_test.pvalue == ref.gap_test.pvalue and ev.gap == pytest.approx(ref.phase_gap)
    # one residue per phase: the nested test is undefined; the period needs the whole cycle
    assert ev.tests.nested is None and "two or more residues" in ev.tests.skipped["nested"]
    assert ev.period is None and "every residue of the cycle" in ev.tests.skipped["period"]
    assert "evaluated residues [0, 1, 2, 3] of 0..7" in repr(ev) and "period not tested" in repr(ev)
    assert len(ev.plot().data) == 1  # one cycle of residues evaluated, not two
    with pytest.raises(NotApplicableError, match="needs every residue"):
        phaselens.plots.periodicity_panel(ev)


def test_evaluate_on_a_paired_subset_uses_the_paired_tests(model):
    ev = phaselens.evaluate(model, tiny_task(paired=True), residues=[0, 1, 2, 3, 4, 6], n_per_residue=8,
                            progress=False, **FAST)
    t = ev.tests
    assert t.design == "paired" and t.n_items == 8 and t.omnibus is t.cochran and t.cochran.df == 5
    assert t.nested is not None and t.nested.name == "nested_cochran_6_vs_4"  # classes {0, 4} and {2, 6}
    assert t.within_item is not None and t.gap_ci is not None and t.gap_ci.scheme == "item-cluster"
    assert ev.per_phase()["phase"].tolist() == [0, 1, 2, 3]


def test_evaluate_with_absent_phases(model):
    ev = phaselens.evaluate(model, residues=[1, 5], n_per_residue=4, progress=False, **FAST)
    assert ev.per_phase()["phase"].tolist() == [1]
    assert np.isnan(ev.boundary) and "boundary phase 3 not evaluated" in repr(ev)
    assert "one phase evaluated: no folded gap" in repr(ev) and ev.tests.gap_ci is None


def test_interventions_and_recordings_on_a_subset(model):
    """ablate, patch, record, specialization_map, attribution_map and repair_table on residues of phases 1
    and 3 only: frames hold those residues and phases, summaries and plots do not break."""
    res = [1, 3, 5]  # zero knockouts: no calibration set to build, so this stays fast
    ab = phaselens.ablate(model, "L0H1", residues=res, n_per_residue=4, progress=False, n_bootstrap=50, method="zero")
    pa = phaselens.patch(model, heads="L0", residues=res, n_per_residue=3, n_bootstrap=50)
    rec = phaselens.record(model, residues=res, n_per_residue=3, progress=False)
    pm = phaselens.specialization_map(model, residues=res, n_per_residue=3, progress=False, n_bootstrap=50,
                                      kinds=("head", "layer"), method="zero")
    am = phaselens.attribution_map(model, residues=res, n_per_residue=3, method="zero")
    rt = phaselens.repair_table(model, residues=res, n_per_residue=3, progress=False, shift_sets=("all",),
                                combines=("max_conf",), **FAST)
    for r in (ab, pa, rec, pm, am, rt):
        assert sorted(set(r.per_residue()["residue"])) == res, type(r).__name__
        assert sorted(set(r.per_phase()["phase"])) == [1, 3], type(r).__name__
        assert repr(r) and len(r.plot().data) > 0
    assert pm.specialization_index()["label"].size == 8 and pm.top_heads(3, k=2)["phase"].tolist() == [3, 3]
    assert len(rec.plot("write").data) > 0
    assert rt.base.residues.tolist() == res
