"""Holm and Benjamini–Hochberg adjustments, against hand-worked examples."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from phaselens import stats


def test_holm_hand_example() -> None:
    # Sorted: .005 .01 .03 .04 → ×4 ×3 ×2 ×1 = .02 .03 .06 .04 → running max .02 .03 .06 .06.
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_holm_caps_at_one_and_keeps_order() -> None:
    assert stats.holm([0.5, 0.6]).tolist() == [1.0, 1.0]
    assert stats.holm([0.2, 0.01, 0.3]) == pytest.approx([0.4, 0.03, 0.4])
    assert stats.holm([0.04]).tolist() == [0.04]
    # Ties: both get the smaller multiplier's running max.
    assert stats.holm([0.01, 0.01, 0.5]) == pytest.approx([0.03, 0.03, 0.5])


def test_bh_hand_examples() -> None:
    # Sorted: .005 .01 .03 .04 → ×4/1 ×4/2 ×4/3 ×4/4 = .02 .02 .04 .04 → running min from the top.
    assert stats.benjamini_hochberg([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert stats.benjamini_hochberg([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx([0.05] * 5)
    assert stats.benjamini_hochberg([0.001, 0.8, 0.9]) == pytest.approx([0.003, 0.9, 0.9])


def test_bh_is_never_stricter_than_holm() -> None:
    p = np.random.default_rng(0).uniform(0, 0.2, size=25)
    assert np.all(stats.benjamini_hochberg(p) <= stats.holm(p) + 1e-15)
    assert np.array_equal(stats.benjamini_hochberg(p), sps.false_discovery_control(p, method="bh"))
