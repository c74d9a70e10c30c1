"""The mechanism on the zoo: the control has no phase-specific heads; compressed models do."""

from __future__ import annotations

import pytest

import phaselens


@pytest.fixture(scope="module")
def maps():
    out = {}
    for name, stride in (("w4s4", None), ("full", 4)):
        model = phaselens.load(f"zoo:{name}")
        out[name] = phaselens.specialization_map(model, n_per_residue=24, progress=False, kinds=("head",),
                                                 n_bootstrap=0, stride=stride, seed=5)
    return out


def test_full_control_has_no_phase_specific_heads(maps):
    si = maps["full"].specialization_index()
    assert not si["significant"].any() and si["score"].max() < 0.1


def test_compressed_model_has_phase_specific_heads(maps):
    si = maps["w4s4"].specialization_index()
    top = maps["w4s4"].most_specialized(1).iloc[0]
    assert si["significant"].any() and top["specialization"] > 0.5 and top["ci_low"] > 0
    assert si["score"].max() > 3 * maps["full"].specialization_index()["score"].max()
