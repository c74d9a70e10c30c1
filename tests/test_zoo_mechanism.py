"""The mechanism on the zoo: the control has no phase-specific heads; compressed models do."""

from __future__ import annotations

import numpy as np
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
    assert np.nan_to_num(si["specialization"].to_numpy(), nan=0.0).max() < 0.5


def test_compressed_model_has_phase_specific_heads(maps):
    si = maps["w4s4"].specialization_index()
    spec = np.nan_to_num(si["specialization"].to_numpy(), nan=0.0)
    full = np.nan_to_num(maps["full"].specialization_index()["specialization"].to_numpy(), nan=0.0)
    assert si["significant"].any()
    assert spec.max() > full.max()
