"""Gate cycling: what rolls, what does not, and the R^2 bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.interventions.cycling import r_squared
from tests.conftest import LAYOUTS, make_model, task_model


def test_cycle_rolls_offset_specific_gate_parameters_only():
    model = make_model(LAYOUTS["w8s4-peroffset"])
    cyc = phaselens.cycle_gates(model, 1)
    for (name, p), q in zip(model.named_parameters(), cyc.parameters()):
        if name.endswith("gate.weight") or name.endswith("position_bias"):
            assert torch.equal(torch.roll(p, 1, dims=1), q), name  # offset i -> offset (i + 1) mod S
        else:
            assert torch.equal(p, q), name  # payload maps and everything else unchanged
    back = phaselens.cycle_gates(cyc, -1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), back.parameters()))


def test_overlap_split_bias_rolls_alike_in_both_halves():
    model = make_model(LAYOUTS["w8s4-deepseek"])
    cyc = phaselens.cycle_gates(model, 2)
    b0 = model.blocks[0].attn.compressor.poolers["kv"].position_bias  # [group (Ca|Cb), phase, channel]
    b1 = cyc.blocks[0].attn.compressor.poolers["kv"].position_bias
    assert torch.equal(b1[0], torch.roll(b0[0], 2, dims=0)) and torch.equal(b1[1], torch.roll(b0[1], 2, dims=0))
    g0 = model.blocks[0].attn.compressor.poolers["kv"].gate.weight
    assert torch.equal(g0, cyc.blocks[0].attn.compressor.poolers["kv"].gate.weight)  # shared gate map stays


def test_uniform_pooling_is_not_applicable():
    with pytest.raises(phaselens.NotApplicableError, match="no compressor with offset-specific gate parameters"):
        phaselens.cycle_gates(make_model(LAYOUTS["w6s3-uniform"]), 1)
    with pytest.raises(phaselens.NotApplicableError):
        phaselens.gate_cycling_test(task_model(LAYOUTS["w6s3-uniform"]), n_per_residue=1, progress=False)


def test_r_squared_and_test_frame():
    obs = np.array([0.2, 0.5, 0.9])
    assert r_squared(obs, obs) == 1.0
    assert r_squared(obs, obs.mean() * np.ones(3)) == pytest.approx(0.0)
    model = task_model(LAYOUTS["w4s4-scalar"])
    res = phaselens.gate_cycling_test(model, deltas=(1, -1, 4), n_per_residue=2, progress=False)
    f = res.frame
    assert sorted(f["delta"].unique()) == [-1, 1]  # delta = 0 mod S is skipped
    ph = res.per_phase()  # the unmodified model is delta 0 there, with the same predicted column
    assert sorted(ph["delta"].unique()) == [-1, 0, 1] and np.allclose(ph[ph["delta"] == 0]["acc"], res.base)
    row = f[(f["delta"] == 1) & (f["phase"] == 2)].iloc[0]
    assert row["predicted"] == pytest.approx(res.base[1])  # A_0((2 - 1) mod 4)
    assert set(res.boundary) == {-1, 1} and "R^2" in repr(res)
