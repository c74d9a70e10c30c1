"""Permutation nulls and bootstrap intervals for the folded gap."""

from __future__ import annotations

import numpy as np
import pytest

from phaselens import stats
from phaselens.errors import StatsInputError

FLASH = np.array([112, 178, 169, 76, 115, 179, 165, 84])


def _null_tables(n_sims: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).binomial(256, 0.6, size=(n_sims, 8))


def test_gap_permutation_detects_a_planted_effect() -> None:
    res = stats.gap_permutation_test(FLASH, 256, 4, n_permutations=999, seed=1)
    assert res.pvalue == pytest.approx(1 / 1000)  # no permuted table comes close to 38 pp
    assert res.statistic == pytest.approx(197 / 512)
    assert 0.02 < res.null_mean < 0.08  # the gap's upward bias with no effect: a few pp, not 0
    assert res.scheme == "unpaired"


def test_gap_permutation_pvalues_are_uniform_under_the_null() -> None:
    p = np.array(
        [
            stats.gap_permutation_test(c, 256, 4, n_permutations=199, seed=i).pvalue
            for i, c in enumerate(_null_tables(300, 0))
        ]
    )
    assert abs(p.mean() - 0.5) < 0.05
    assert abs((p <= 0.05).mean() - 0.05) < 0.03
    assert abs((p <= 0.5).mean() - 0.5) < 0.08


def test_harmonic_pvalues_are_uniform_under_the_null() -> None:
    p = np.array(
        [
            stats.harmonic_fraction(c, 256, 4, n_permutations=199, seed=i).pvalue
            for i, c in enumerate(_null_tables(300, 1))
        ]
    )
    assert abs(p.mean() - 0.5) < 0.05
    assert abs((p <= 0.05).mean() - 0.05) < 0.03


def test_permutations_are_deterministic_for_a_seed() -> None:
    a = stats.gap_permutation_test(FLASH - 40, 256, 4, n_permutations=99, seed=3)
    b = stats.gap_permutation_test(FLASH - 40, 256, 4, n_permutations=99, seed=3)
    c = stats.gap_permutation_test(FLASH - 40, 256, 4, n_permutations=99, seed=4)
    assert (a.pvalue, a.null_mean) == (b.pvalue, b.null_mean)
    assert a.null_mean != c.null_mean


def _paired(n_items: int, acc: np.ndarray, spread: float, seed: int) -> np.ndarray:
    """0/1 outcomes [items, M]: item difficulty (logit shift with sd ``spread``) plus a residue effect."""
    rng = np.random.default_rng(seed)
    logit = np.log(acc / (1 - acc))[None, :] + rng.normal(0, spread, size=(n_items, 1))
    return (rng.random((n_items, acc.size)) < 1 / (1 + np.exp(-logit))).astype(int)


def test_within_item_permutation_planted_and_null() -> None:
    planted = _paired(200, np.tile([0.5, 0.7, 0.7, 0.35], 2), 1.0, seed=0)
    res = stats.within_item_permutation_test(planted, 4, n_permutations=999, seed=0)
    assert res.pvalue < 0.01 and res.scheme == "within-item"
    assert res.statistic == pytest.approx(np.ptp(planted.reshape(200, 2, 4).mean(axis=(0, 1))))
    null = [_paired(200, np.full(8, 0.6), 1.5, seed=s) for s in range(200)]
    p = np.array(
        [
            stats.within_item_permutation_test(x, 4, n_permutations=99, seed=s).pvalue
            for s, x in enumerate(null)
        ]
    )
    # Ties in the discrete gap make the test slightly conservative (mean p a little above 0.5); the SE of the
    # mean over 200 simulations is 0.02.
    assert abs(p.mean() - 0.5) < 0.07
    assert (p <= 0.05).mean() < 0.09


def test_within_item_is_sharper_than_unpaired_with_item_effects() -> None:
    # Strong item difficulty: pairing removes it from the null, so a modest effect shows up more clearly.
    x = _paired(120, np.tile([0.55, 0.65, 0.65, 0.5], 2), 2.5, seed=4)
    paired = stats.within_item_permutation_test(x, 4, n_permutations=1999, seed=0)
    unpaired = stats.gap_permutation_test(x.sum(0), 120, 4, n_permutations=1999, seed=0)
    assert paired.statistic == pytest.approx(unpaired.statistic)
    assert paired.null_mean < unpaired.null_mean
    assert paired.pvalue < unpaired.pvalue


def test_within_item_chunks_agree_with_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from phaselens.stats import resampling

    x = _paired(30, np.full(8, 0.5), 1.0, seed=2)
    whole = stats.within_item_permutation_test(x, 4, n_permutations=500, seed=5)
    monkeypatch.setattr(resampling, "_CHUNK_ELEMENTS", 30 * 8 * 7)  # 7 permutations per chunk
    chunked = stats.within_item_permutation_test(x, 4, n_permutations=500, seed=5)
    assert chunked.n_permutations == 500
    assert 0.0 <= chunked.pvalue <= 1.0 and abs(chunked.null_mean - whole.null_mean) < 0.01


def test_gap_ci_from_counts() -> None:
    # The pairwise-difference interval (tests/stats/test_gapci.py covers its coverage).
    res = stats.gap_ci(FLASH, 256, 4, n_draws=2000, seed=0)
    assert isinstance(res, stats.GapInterval) and res.scheme == "independent trials"
    assert res.ci_low < res.estimate < res.ci_high
    # The folded gap 38.5 pp has a binomial SE of about 3 pp: a 95% CI about ±6-7 pp wide.
    assert 0.29 < res.ci_low < 0.33 and 0.42 < res.ci_high < 0.46


def _frame_arrays(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    items, m = x.shape
    return np.repeat(np.arange(items), m), np.tile(np.arange(m), items), x.ravel()


def test_item_cluster_interval_uses_the_pairing() -> None:
    # With strong item effects in a paired design the gap's sampling error is smaller than rows-as-independent
    # suggests, because every item contributes to every phase.
    x = _paired(150, np.tile([0.5, 0.7, 0.65, 0.35], 2), 3.0, seed=1)
    ids, res, val = _frame_arrays(x)
    cluster = stats.item_gap_ci(ids, res, val, 4, n_draws=2000, seed=0)
    naive = stats.gap_ci(x.sum(0), 150, 4, seed=0)
    assert cluster.scheme == "item-cluster"
    assert cluster.estimate == pytest.approx(naive.estimate)
    assert (cluster.ci_high - cluster.ci_low) < 0.85 * (naive.ci_high - naive.ci_low)


def test_item_interval_with_one_item_per_row_matches_counts() -> None:
    # Each item answered once: the item-cluster covariance reduces to the binomial one, and the pseudo-items
    # to the Agresti-Caffo adjustment, so the item path and the count path give the same bounds.
    rng = np.random.default_rng(3)
    res = np.repeat(np.arange(8), 300)
    val = (rng.random(res.size) < np.tile([0.45, 0.7, 0.65, 0.3], 2)[res]).astype(float)
    items = stats.item_gap_ci(np.arange(res.size), res, val, 4, seed=0)
    counts = stats.gap_ci(np.bincount(res, weights=val).astype(int), 300, 4, seed=0)
    assert items.scheme == "items, one phase each"
    assert items.estimate == pytest.approx(counts.estimate)
    assert items.ci_low == pytest.approx(counts.ci_low, abs=2e-3)
    assert items.ci_high == pytest.approx(counts.ci_high, abs=2e-3)


def test_item_interval_needs_every_phase() -> None:
    with pytest.raises(StatsInputError, match=r"phases \[3\]"):
        stats.item_gap_ci(np.arange(6), [0, 1, 2, 4, 5, 6], np.ones(6), 4, modulus=8)
