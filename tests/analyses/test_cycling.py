"""Gate cycling: what rolls, what does not, and the R^2 bookkeeping."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

import phaselens
from phaselens.analyses.cycling import r_squared
from tests.support.models import LAYOUTS, make_model, task_model


def test_cycle_rolls_offset_specific_gate_parameters_only():
    model = make_model(LAYOUTS["w8s4-peroffset"])
    cyc = phaselens.analyses.cycling.cycle_gates(model, 1)
    for (name, p), q in zip(model.named_parameters(), cyc.parameters()):
        if name.endswith("gate.weight") or name.endswith("position_bias"):
            assert torch.equal(torch.roll(p, 1, dims=1), q), name  # offset i -> offset (i + 1) mod S
        else:
            assert torch.equal(p, q), name  # payload maps and everything else unchanged
    back = phaselens.analyses.cycling.cycle_gates(cyc, -1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), back.parameters()))


def test_overlap_split_bias_rolls_alike_in_both_halves():
    model = make_model(LAYOUTS["w8s4-deepseek"])
    cyc = phaselens.analyses.cycling.cycle_gates(model, 2)
    b0 = model.blocks[0].attn.compressor.poolers["kv"].position_bias  # [group (Ca|Cb), phase, channel]
    b1 = cyc.blocks[0].attn.compressor.poolers["kv"].position_bias
    assert torch.equal(b1[0], torch.roll(b0[0], 2, dims=0)) and torch.equal(b1[1], torch.roll(b0[1], 2, dims=0))
    g0 = model.blocks[0].attn.compressor.poolers["kv"].gate.weight
    assert torch.equal(g0, cyc.blocks[0].attn.compressor.poolers["kv"].gate.weight)  # shared gate map stays


def test_uniform_pooling_is_not_applicable():
    with pytest.raises(phaselens.errors.NotApplicableError, match="no compressor with offset-specific gate parameters"):
        phaselens.analyses.cycling.cycle_gates(make_model(LAYOUTS["w6s3-uniform"]), 1)
    with pytest.raises(phaselens.errors.NotApplicableError):
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


def test_cycling_r2_matches_r_squared_and_weighted_accuracy_matches_pandas():
    from phaselens.analyses.cycling import _weighted_accuracy, cycling_r2

    rng = np.random.default_rng(3)
    acc, deltas, S = rng.random((5, 4, 6)), (1, 3, 5), 6  # a batch of 5 profile sets, 3 deltas, S = 6
    for b in range(5):
        obs = [acc[b, 1 + i, p] for i, d in enumerate(deltas) for p in range(S - 1)]
        pred = [acc[b, 0, (p - d) % S] for d in deltas for p in range(S - 1)]
        assert cycling_r2(acc, deltas)[b] == pytest.approx(r_squared(np.array(obs), np.array(pred)), abs=1e-12)
    # One bootstrap replicate by hand: explicit resampled rows, accuracy by pandas groupby.
    rng = np.random.default_rng(0)
    n, S = 40, 4
    residue = np.repeat(np.arange(8), 5)
    y = rng.random((n, 3)) < 0.6
    rows = rng.integers(0, n, n)
    frame = pd.DataFrame(y[rows].astype(float)).assign(phase=residue[rows] % S)
    expect = frame.groupby("phase").mean().T.to_numpy()  # [models, S]
    weights = np.bincount(rows, minlength=n).astype(float)[None]
    design = (y[:, :, None] * np.eye(S)[residue % S][:, None, :]).reshape(n, -1).astype(float)
    assert np.allclose(_weighted_accuracy(weights, design, np.eye(S)[residue % S])[0], expect)


def test_r2_interval_covers_in_simulation():
    """Seeded simulation of paired items with item heterogeneity (experiments/sim_cycling_ci.py; full table in
    docs/zoo.md): the basic interval covers the population R^2 where the percentile one misses near 1."""
    from experiments.sim_cycling_ci import SCENARIOS, simulate

    near_one = simulate(SCENARIOS["gate-driven (R^2 near 1)"], 16, reps=200, n_bootstrap=300, seed=5)
    assert near_one["true_r2"] > 0.95 and near_one["mean_estimate"] < near_one["true_r2"] - 0.05  # biased low
    assert near_one["coverage_basic"] >= 0.92 and near_one["coverage_percentile"] < 0.2
    moves = simulate(SCENARIOS["w4s4-like (moves, boundary stays)"], 16, reps=200, n_bootstrap=300, seed=6)
    assert moves["coverage_basic"] >= 0.90  # nominal 0.95; Monte-Carlo SE 0.015


def test_r2_interval_rejects_bad_input():
    from phaselens.analyses.cycling import r2_bootstrap_ci

    with pytest.raises(phaselens.PhaseLensError, match=r"correct must be \[N, 1 \+ len\(deltas\)\]"):
        r2_bootstrap_ci(np.zeros((8, 2)), np.arange(8), (1, 2), 4)
    with pytest.raises(phaselens.PhaseLensError, match="method must be"):
        r2_bootstrap_ci(np.zeros((8, 3)), np.arange(8), (1, 2), 4, method="bca")


def test_overlap_roll_is_periodic_in_the_stride():
    """Rolling inside each half is periodic mod S; rolling the 2S slots as one sequence would not be."""
    model = make_model(LAYOUTS["w8s4-deepseek"])
    same = phaselens.analyses.cycling.cycle_gates(model, 4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    a, b = phaselens.analyses.cycling.cycle_gates(model, 1), phaselens.analyses.cycling.cycle_gates(model, -3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def _planted_w8s4(q: int, depth: float = 8.0):
    """zoo:w8s4 (DeepSeek overlap layout) with every phase-specific gate parameter removed (each half's
    position bias replaced by its mean over phases, both layers) and a weakness planted in the gates: tokens
    of phase q get a large negative gate bias in both halves of layer 0."""
    model = phaselens.load("zoo:w8s4")
    with torch.no_grad():
        for block in model.blocks:
            b = block.attn.compressor.poolers["kv"].position_bias  # [half (Ca|Cb), phase, channel]
            b.copy_(b.mean(1, keepdim=True).expand_as(b))
        model.blocks[0].attn.compressor.poolers["kv"].position_bias[:, q] -= depth
    return model


_Q, _S = 1, 4


def _dips_at(acc, phases):
    """Phases ``phases`` (mod S) dipped below 15%, every other phase above 25%."""
    weak = {p % _S for p in phases}
    return all(acc[p] < 0.15 for p in weak) and all(acc[p] > 0.25 for p in set(range(_S)) - weak)


def test_planted_gate_weakness_moves_on_the_overlap_layout_fast():
    """The fast version of the test below: one shift, delta = 2, moves the planted dips from {0, 1} to {2, 3}."""
    planted = _planted_w8s4(_Q)
    res = phaselens.gate_cycling_test(planted, deltas=(2,), n_per_residue=8, batch_size=192, progress=False,
                                      n_bootstrap=0)
    assert _dips_at(res.base, (_Q - 1, _Q))
    assert _dips_at(res.frame["observed"].to_numpy(), (_Q + 1, _Q + 2)), res.frame


@pytest.mark.slow
def test_planted_gate_weakness_moves_with_delta_on_the_overlap_layout():
    """A weakness that lives in the gates must move with delta: the dropped phase q breaks the records whose
    key (phase q) or value (phase q, so key at q - 1) it holds, and cycling by delta must move both dips to
    q + delta and q - 1 + delta while the phases they leave recover. Rolling only the Ca half (a wrong
    operation for the overlap split) leaves a dip behind, so the check can fail."""
    from phaselens.analyses.cycling import cycling_r2

    q, dips_at = _Q, _dips_at
    planted = _planted_w8s4(q)
    res = phaselens.gate_cycling_test(planted, deltas=(1, 2, 3), n_per_residue=8, batch_size=192, progress=False,
                                      n_bootstrap=200)
    assert dips_at(res.base, (q - 1, q))
    acc = np.vstack([res.base] + [res.frame[res.frame["delta"] == d]["observed"].to_numpy() for d in (1, 2, 3)])
    for delta in (1, 2, 3):
        assert dips_at(acc[delta], (q - 1 + delta, q + delta)), (delta, acc[delta])
    assert cycling_r2(acc, (1, 2, 3)) == pytest.approx(res.r2, abs=1e-12)
    assert res.r2_ci[0] <= res.r2 <= res.r2_ci[1] <= 1 and res.r2_all_ci[0] <= res.r2_all <= res.r2_all_ci[1]
    wrong = copy.deepcopy(planted)
    with torch.no_grad():
        for block in wrong.blocks:
            b = block.attn.compressor.poolers["kv"].position_bias
            b[0] = torch.roll(b[0], 1, dims=0)  # Ca half only
    wrong_acc = phaselens.evaluate(wrong, n_per_residue=8, seed=0, batch_size=192, progress=False, n_permutations=1,
                                   n_bootstrap=0).per_phase()["acc"].to_numpy()
    assert not dips_at(wrong_acc, (q, q + 1))


def test_an_undefined_r2_states_no_finding():
    """The observed accuracy does not vary over phases: R^2 is NaN, and neither the summary nor the figure
    says the weak phases did or did not move."""
    import pandas as pd

    from phaselens import plots
    from phaselens.results.gate_cycling import PhaseGateCycling

    frame = pd.DataFrame({"delta": [1] * 4, "phase": range(4), "observed": [1.0] * 4, "predicted": [1.0] * 4,
                          "boundary": [False, False, False, True]})
    res = PhaseGateCycling(frame, float("nan"), float("nan"), {1: 1.0}, np.ones(4), 4)
    text = res.summary()
    assert "undefined" in text and "cannot tell" in text and "did not move" not in text and "nan" not in text
    assert "cannot tell" in plots.r2_note(res.r2)
    title = plots.gate_cycling_scatter(res).layout.title.text
    assert "undefined" in title and "nan" not in title
