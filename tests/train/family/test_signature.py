"""The paper's signature on tiny members of the family trained here (`phaselens train --recipe paper-w4s4 --size
tiny`, `--recipe paper-full`; weights in tests/data/family, 0.44 MB each): on the paper's task the compressed
member's accuracy has period 4 (its stride) and a phase gap far above the full-attention control's, measured
with phaselens's own battery. docs/training.md has the full evaluation (256 items per residue, both padding
schemes, and a stride-8 member)."""

from __future__ import annotations

import pytest

import phaselens
from phaselens.train.family.recipes import family_config, paper_task
from tests.support.paths import DATA as TEST_DATA

DATA = TEST_DATA / "family"
N = 32  # items per residue: 768 items; the gaps below are ~0.98 against ~0, far beyond sampling error at this n


@pytest.fixture(scope="module")
def members():
    return {name: phaselens.load(DATA / f"paper-{name}-tiny") for name in ("w4s4", "full")}


def test_shipped_members_are_the_recipes(members):
    for name, model in members.items():
        assert model.config == family_config(name, "tiny")
        assert model.default_task == paper_task("prefix")
        assert model.metadata["training"]["steps"] == (2400 if name == "w4s4" else 2200)


def test_period_follows_the_stride_and_the_gap_is_far_above_the_controls(members):
    comp = phaselens.evaluate(members["w4s4"], n_per_residue=N, seed=3, n_permutations=200, n_bootstrap=200,
                              progress=False)
    ctrl = phaselens.evaluate(members["full"], n_per_residue=N, seed=3, stride=4, n_permutations=200,
                              n_bootstrap=200, progress=False)
    c, k = comp.tests.counts, ctrl.tests.counts
    assert c.period.period == 4  # the battery's detected period: the stride
    assert c.boundary_accuracy == c.worst_accuracy < 0.2  # the boundary phase is the weak one
    assert c.phase_gap > 0.8 and k.phase_gap < 0.1  # card (256 per residue): 98.2 pp against the control's
    assert comp.gap_ci[0] > ctrl.gap_ci[1] + 0.5  # the intervals are far apart
    assert k.mean_accuracy > c.mean_accuracy  # the control learned the task (so its flat profile is not chance)
