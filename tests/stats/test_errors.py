"""Bad input raises StatsInputError (or ResidueError for geometry) with a message that names the fix."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from phaselens import stats
from phaselens.errors import PhaseLensError, ResidueError, StatsInputError

FLASH = [112, 178, 169, 76, 115, 179, 165, 84]


def test_counts_above_n() -> None:
    with pytest.raises(
        StatsInputError, match=r"correct\[2\] = 300 exceeds n\[2\] = 256; counts must satisfy"
    ):
        stats.chi2_test([10, 20, 300], 256)


def test_negative_counts() -> None:
    with pytest.raises(StatsInputError, match=r"correct\[1\] = -1 is negative"):
        stats.phase_battery([10, -1, 3, 4], 256, stride=4)


def test_n_below_one() -> None:
    with pytest.raises(
        StatsInputError, match=r"n\[1\] = 0 is below 1; every residue needs at least one trial"
    ):
        stats.wilson_ci([0, 0], [5, 0])


def test_mismatched_lengths() -> None:
    with pytest.raises(StatsInputError, match="correct has 8 residues but n has 7; pass n as one int"):
        stats.phase_battery(FLASH, [256] * 7, stride=4)


def test_fractional_counts() -> None:
    with pytest.raises(StatsInputError, match="whole counts.*not accuracies"):
        stats.g_test([0.4, 0.6], 256)


def test_empty_input() -> None:
    with pytest.raises(StatsInputError, match="correct is empty"):
        stats.phase_battery([], 256, stride=4)
    with pytest.raises(StatsInputError, match="frame is empty"):
        stats.phase_battery_items(pd.DataFrame({"item_id": [], "residue": [], "correct": []}), 4)
    with pytest.raises(StatsInputError, match="pvalues must be a non-empty 1-D array"):
        stats.holm([])


def test_modulus_not_multiple_of_stride() -> None:
    with pytest.raises(ResidueError, match="modulus 6 is not a multiple of stride 4.*such as 8"):
        stats.phase_battery([10] * 6, 20, stride=4)
    with pytest.raises(ResidueError, match="modulus 8 is not a multiple of stride 3"):
        stats.harmonic_fraction(FLASH, 256, 3)


def test_modulus_disagrees_with_counts() -> None:
    with pytest.raises(ResidueError, match="modulus 16 but correct has 8 residues"):
        stats.phase_battery(FLASH, 256, stride=4, modulus=16)


def test_period_must_divide_modulus() -> None:
    with pytest.raises(ResidueError, match=r"period 3 does not divide modulus 8; use one of \[1, 2, 4, 8\]"):
        stats.nested_fold_test(FLASH, 256, 3)


def test_residue_outside_modulus() -> None:
    frame = pd.DataFrame({"item_id": [0, 1], "residue": [0, 9], "correct": [1, 0]})
    with pytest.raises(ResidueError, match=r"residue 9 is outside 0..7; reduce positions mod 8"):
        stats.phase_battery_items(frame, 4, modulus=8)
    with pytest.raises(ResidueError, match="residue -1 is outside"):
        stats.continuous_phase_tests([1.0, 2.0], [-1, 1], 2, modulus=2)


def test_frame_problems() -> None:
    with pytest.raises(StatsInputError, match=r"frame lacks columns \['correct'\]"):
        stats.phase_battery_items(pd.DataFrame({"item_id": [0], "residue": [0]}), 4)
    bad = pd.DataFrame({"item_id": [0, 0], "residue": [0, 1], "correct": [0.5, 1.0]})
    with pytest.raises(StatsInputError, match="must be 0/1 or bool"):
        stats.phase_battery_items(bad, 2)
    gappy = pd.DataFrame({"item_id": [0, 1], "residue": [0, 2], "correct": [1, 0]})
    with pytest.raises(StatsInputError, match=r"residues \[1, 3\] have no rows"):
        stats.phase_battery_items(gappy, 4)
    nan = pd.DataFrame({"item_id": [0, 1], "residue": [0, 1], "correct": [1, 0], "nll": [0.1, np.nan]})
    with pytest.raises(StatsInputError, match="column 'nll' contains NaN or inf; drop or impute"):
        stats.phase_battery_items(nan, 2)


def test_bad_settings() -> None:
    with pytest.raises(StatsInputError, match="alpha must be a number strictly between 0 and 1"):
        stats.detect_period(FLASH, 256, alpha=1.5)
    with pytest.raises(StatsInputError, match="n_permutations must be a positive int"):
        stats.gap_permutation_test(FLASH, 256, 4, n_permutations=0)
    with pytest.raises(StatsInputError, match="level must be a number strictly between 0 and 1"):
        stats.wilson_ci(3, 10, level=95)
    with pytest.raises(ResidueError, match="stride must be at least 1"):
        stats.folded_gap(FLASH, 256, 0)


def test_structured_inputs() -> None:
    with pytest.raises(StatsInputError, match="cochran_q needs 0/1"):
        stats.cochran_q([[0, 2], [1, 1]])
    with pytest.raises(StatsInputError, match=r"shape \(strata, I, J\).*tables\[None\]"):
        stats.cmh_test(np.ones((2, 8)))
    with pytest.raises(StatsInputError, match=r"pvalues must lie in \[0, 1\]"):
        stats.benjamini_hochberg([0.2, 1.2])
    with pytest.raises(StatsInputError, match="groups overlap"):
        stats.group_means([1.0, 2.0], [0, 1], 4, [{0, 1}, {1, 2}])
    with pytest.raises(ResidueError, match=r"group phases must lie in 0..3"):
        stats.group_means([1.0, 2.0], [0, 1], 4, [{4}])
    with pytest.raises(StatsInputError, match=r"no position has a phase in \[3\]"):
        stats.group_means([1.0, 2.0], [0, 1], 4, [{0}, {3}])


def test_errors_are_value_errors_and_phaselens_errors() -> None:
    for exc in (StatsInputError, ResidueError):
        assert issubclass(exc, ValueError) and issubclass(exc, PhaseLensError)
