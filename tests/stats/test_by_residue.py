"""Per-residue means and t intervals: one batched reduction equals the per-residue loop and scipy."""

from __future__ import annotations

import doctest

import numpy as np
import scipy.stats as sps

import phaselens.stats.by_residue as br


def test_matches_a_loop_and_scipy_with_nan_and_empty_residues():
    rng = np.random.default_rng(0)
    n, M = 200, 6
    residue = rng.integers(0, M - 1, n)  # residue M-1 stays empty
    values = rng.normal(size=(n, 3, 4))
    values[rng.random(values.shape) < 0.1] = np.nan
    values[:, 2, 3] = np.nan  # a cell with no finite value anywhere
    mean, lo, hi = br.residue_mean_ci(values, residue, M)
    assert mean.shape == (3, 4, M)
    for r in range(M):
        for i in range(3):
            for j in range(4):
                v = values[residue == r, i, j]
                v = v[~np.isnan(v)]
                if len(v) == 0:
                    assert np.isnan(mean[i, j, r]) and np.isnan(lo[i, j, r])
                    continue
                assert np.isclose(mean[i, j, r], v.mean())
                a, b = sps.t.interval(0.95, len(v) - 1, loc=v.mean(), scale=sps.sem(v))
                assert np.isclose(lo[i, j, r], a) and np.isclose(hi[i, j, r], b)


def test_a_single_value_has_a_mean_but_no_interval():
    mean, lo, hi = br.residue_mean_ci(np.array([2.0, 4.0, 7.0]), np.array([0, 0, 1]), 2)
    assert mean.tolist() == [3.0, 7.0]
    assert np.isnan(lo[1]) and np.isnan(hi[1]) and lo[0] < 3.0 < hi[0]


def test_docstring_examples():
    assert doctest.testmod(br).failed == 0
