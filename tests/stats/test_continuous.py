"""Phase tests for continuous per-item metrics."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from phaselens import stats


def _paired_nll(n_items: int, effect: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (item, residue, nll) of a paired design: item offset + per-residue effect + noise."""
    rng = np.random.default_rng(seed)
    m = effect.size
    nll = (
        1.0 + rng.normal(0, 0.5, size=(n_items, 1)) + effect[None, :] + rng.normal(0, 0.3, size=(n_items, m))
    )
    return np.repeat(np.arange(n_items), m), np.tile(np.arange(m), n_items), nll.ravel()


def test_planted_phase_effect_in_paired_nll() -> None:
    ids, res, nll = _paired_nll(80, np.tile([0.0, 0.0, 0.0, 0.3], 2), seed=0)
    out = stats.continuous_phase_tests(nll, res, 4, item_ids=ids, metric="nll", n_permutations=999)
    assert out.metric == "nll"
    assert out.kruskal.pvalue < 0.01 and out.friedman is not None and out.friedman.pvalue < 1e-6
    assert out.permutation.scheme == "within-item" and out.permutation.pvalue < 0.01
    assert int(np.argmax(out.phase_means)) == 3
    assert out.phase_n.tolist() == [160] * 4
    # Friedman runs on each item's phase means (two residues per phase averaged).
    per_phase = nll.reshape(80, 2, 4).mean(axis=1)
    ref = sps.friedmanchisquare(*per_phase.T)
    assert out.friedman.statistic == pytest.approx(ref.statistic) and out.friedman.df == 3
    groups = [nll[res % 4 == p] for p in range(4)]
    assert out.kruskal.statistic == pytest.approx(sps.kruskal(*groups).statistic)


def test_no_effect_gives_no_evidence() -> None:
    ids, res, nll = _paired_nll(80, np.zeros(8), seed=1)
    out = stats.continuous_phase_tests(nll, res, 4, item_ids=ids, n_permutations=999, seed=2)
    assert out.kruskal.pvalue > 0.05 and out.friedman.pvalue > 0.05 and out.permutation.pvalue > 0.05


def test_unpaired_uses_scipy_permutation_across_phases() -> None:
    rng = np.random.default_rng(3)
    res = rng.integers(0, 8, size=400)
    val = rng.normal(size=400) + 0.5 * (res % 4 == 1)
    out = stats.continuous_phase_tests(val, res, 4, n_permutations=999)
    assert out.friedman is None and out.friedman_skipped == "no item_ids given"
    assert out.permutation.scheme == "unpaired" and out.permutation.pvalue < 0.01
    assert out.permutation.n_permutations == 999
    means = [val[res % 4 == p].mean() for p in range(4)]
    assert out.permutation.statistic == pytest.approx(np.ptp(means))
    # Nested items (each at one residue) are not paired either.
    out2 = stats.continuous_phase_tests(val, res, 4, item_ids=np.arange(400), n_permutations=99)
    assert out2.friedman_skipped is not None and out2.friedman_skipped.startswith("not paired")


def test_friedman_needs_three_phases() -> None:
    ids, res, nll = _paired_nll(30, np.zeros(8), seed=4)
    out = stats.continuous_phase_tests(nll, res, 2, item_ids=ids, n_permutations=99)
    assert out.friedman is None
    assert "at least 3 phases" in out.friedman_skipped
    assert out.permutation.scheme == "within-item"


def test_constant_metric_has_no_evidence() -> None:
    out = stats.continuous_phase_tests(np.ones(16), np.arange(16) % 8, 4, n_permutations=99)
    assert out.kruskal.statistic == 0.0 and out.kruskal.pvalue == 1.0
    assert out.permutation.statistic == 0.0 and out.permutation.pvalue == 1.0


def test_frame_and_repr() -> None:
    ids, res, nll = _paired_nll(20, np.zeros(4), seed=5)
    out = stats.continuous_phase_tests(nll, res, 4, item_ids=ids, metric="nll", n_permutations=99)
    frame = out.to_frame()
    assert frame["test"].tolist() == ["kruskal", "friedman", "gap permutation (within-item)"]
    assert set(frame["metric"]) == {"nll"}
    assert repr(out).startswith("ContinuousResult(nll: phase means [")


def test_items_that_never_vary_across_phases_give_no_friedman_evidence() -> None:
    # Each item has one value at every residue (different between items): every Friedman block is tied.
    ids = np.repeat(np.arange(10), 8)
    res = np.tile(np.arange(8), 10)
    out = stats.continuous_phase_tests(ids * 0.1, res, 4, item_ids=ids, n_permutations=99)
    assert out.friedman is not None and (out.friedman.statistic, out.friedman.pvalue) == (0.0, 1.0)
    assert out.kruskal.pvalue == pytest.approx(1.0) and out.permutation.pvalue == 1.0


def test_ptp_permutation_matches_scipy_and_holds_its_size_with_single_rows() -> None:
    """The fallback for groups of one row (scipy refuses them) draws scipy's null: same statistic, p-values
    within Monte Carlo error of scipy's on groups scipy accepts, and a 5% size under the null with
    one-row groups (400 seeded experiments; binomial 99.9% band)."""
    from phaselens.stats.continuous import _ptp_of_means, ptp_permutation

    rng = np.random.default_rng(0)
    for shift in (0.0, 0.8):
        groups = [rng.normal(size=6), rng.normal(size=5) + shift, rng.normal(size=7)]
        stat, p, null = ptp_permutation(groups, 20_000, 1)
        ref = sps.permutation_test(groups, _ptp_of_means, permutation_type="independent", vectorized=True,
                                   n_resamples=20_000, alternative="greater", random_state=np.random.default_rng(2))
        assert stat == pytest.approx(ref.statistic, rel=1e-12) and null.size == 20_000
        assert abs(p - ref.pvalue) < 0.015
    rejections = sum(ptp_permutation([rng.normal(size=1), rng.normal(size=3), rng.normal(size=2)], 199, k)[1] <= 0.05
                     for k in range(400))
    low, high = sps.binom.ppf([0.0005, 0.9995], 400, 0.05)
    assert low <= rejections <= high, rejections
