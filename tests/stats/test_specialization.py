"""The bias-corrected specialization measure, checked by seeded simulation (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from phaselens.stats.specialization import concentration, specialization

S = 4


def simulate(rng, n_per_phase: int, cells: int, ko_acc: np.ndarray, clean_acc: float = 0.8):
    """Paired items: clean correct with ``clean_acc``; the knockout keeps a correct answer with probability
    ``ko_acc[p] / clean_acc`` at phase p (so its accuracy there is ``ko_acc[p]``)."""
    phase = np.repeat(np.arange(S), n_per_phase)
    clean = rng.random(len(phase)) < clean_acc
    keep = np.asarray(ko_acc)[phase] / clean_acc
    ko = clean[None] & (rng.random((cells, len(phase))) < keep[None])
    return clean, ko, phase


def test_no_specialization_stays_near_zero_at_every_n_while_the_raw_index_drifts():
    """Damage alike at every phase: the raw concentration falls with n (noise), the corrected one stays ~0."""
    rng = np.random.default_rng(0)
    flat = np.full(S, 0.56)  # a 30% relative loss at every phase
    raw, si = {}, {}
    for n in (16, 64, 256):
        clean, ko, phase = simulate(rng, n, 150, flat)
        sp = specialization(clean, ko, phase, S, n_permutations=100, n_bootstrap=0, seed=1)
        raw[n], si[n] = sp.raw.mean(), sp.specialization.mean()
    assert raw[16] > raw[256] + 0.02  # the trap the correction removes
    assert all(abs(v) < 0.03 for v in si.values()), si


def test_planted_single_phase_damage_is_near_one():
    rng = np.random.default_rng(1)
    clean, ko, phase = simulate(rng, 64, 20, np.array([0.8, 0.8, 0.8, 0.0]))
    sp = specialization(clean, ko, phase, S, n_permutations=100, n_bootstrap=100, seed=2)
    assert (sp.specialization > 0.9).all() and (sp.worst_phase == 3).all() and (sp.p_perm < 0.02).all()
    assert (sp.ci_low > 0.8).all() and (sp.score > 0.9).all()


def test_shuffled_phases_remove_the_specialization():
    """Permuting the items' phases destroys a planted effect: the measure goes back to ~0."""
    rng = np.random.default_rng(2)
    clean, ko, phase = simulate(rng, 64, 30, np.array([0.8, 0.8, 0.8, 0.1]))
    shuffled = rng.permutation(phase)
    sp = specialization(clean, ko, shuffled, S, n_permutations=100, n_bootstrap=0, seed=3)
    assert abs(sp.specialization.mean()) < 0.05


def test_permutation_p_has_its_size_and_the_interval_covers_zero_under_the_null():
    """Under no specialization, p_perm < 0.05 in about 5% of cells and the 95% CI covers 0 in about 95%."""
    rng = np.random.default_rng(3)
    clean, ko, phase = simulate(rng, 48, 400, np.full(S, 0.5))
    sp = specialization(clean, ko, phase, S, n_permutations=199, n_bootstrap=200, seed=4)
    size = (sp.p_perm < 0.05).mean()
    se = np.sqrt(0.05 * 0.95 / 400)
    assert abs(size - 0.05) < 3 * se + 0.01, size
    cover = ((sp.ci_low <= 0) & (sp.ci_high >= 0)).mean()
    assert cover >= 0.90, cover


def test_negligible_damage_never_heads_the_ranking():
    """One lost item at one phase is fully 'concentrated' but negligible: the score ranks it last."""
    rng = np.random.default_rng(4)
    clean, ko, phase = simulate(rng, 64, 2, np.array([0.8, 0.8, 0.8, 0.2]))
    tiny = clean.copy()
    tiny[np.flatnonzero(clean & (phase == 1))[0]] = False
    sp = specialization(clean, np.vstack([ko, tiny[None]]), phase, S, n_permutations=100, n_bootstrap=0)
    assert sp.raw[2] > 0.99 and sp.score[2] < 0.05 < sp.score[:2].min()


def test_concentration_bounds():
    assert concentration(np.array([1.0, 1, 1, 1])) == pytest.approx(0)
    assert concentration(np.array([0.0, 0, 0.5, 0])) == pytest.approx(1)
    assert concentration(np.zeros(4)) == 0


def test_a_knockout_that_damages_nothing_has_no_specialization():
    """No phase damaged: the index is undefined (NaN), not the negative (0 - E[I_null]) / (1 - E[I_null]) that
    read as 'anti-specialized' (-3.65 on w4s4), and not 0; its score is 0 and its worst phase -1."""
    rng = np.random.default_rng(5)
    clean, ko, phase = simulate(rng, 32, 2, np.array([0.8, 0.8, 0.8, 0.1]))
    untouched = clean.copy()  # the knockout changes no answer
    lost_noise = clean.copy()  # noise: one item lost at one phase and one gained elsewhere still damages
    lost_noise[np.flatnonzero(clean & (phase == 2))[0]] = False
    sp = specialization(clean, np.vstack([ko, untouched[None], lost_noise[None]]), phase, S, n_permutations=100,
                        n_bootstrap=50, seed=1)
    assert np.isnan(sp.specialization[2]) and np.isnan(sp.ci_low[2]) and np.isnan(sp.ci_high[2])
    assert np.isnan(sp.raw[2]) and sp.worst_phase[2] == -1 and sp.score[2] == 0
    assert np.isfinite(sp.specialization[[0, 1, 3]]).all() and sp.worst_phase[3] == 2
