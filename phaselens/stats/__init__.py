"""Statistics for phase sensitivity (science.md §4).

Everything works on per-residue counts (``correct``, ``n`` over residues r = (t − origin) mod M) or on
per-item rows; residues fold onto phases r mod S. Start with :func:`phase_battery` (counts) or
:func:`phase_battery_items` (a per-item frame); the building blocks are exported too.

Modules:

* ``intervals``: Wilson intervals; ``folding``: fold mod S, gaps;
* ``omnibus``: χ², G, Cochran's Q, CMH;
* ``periodicity``: nested fold test, harmonic fraction, period detection;
* ``resampling``: permutation nulls; ``continuous``: NLL / logit-difference tests;
* ``gapci`` (with ``contrasts``): the folded gap's interval; ``paired``: tests for paired items;
* ``period``: period detection; ``published``: accuracies with n, gate cycling and knockout summaries;
* ``multiple``: Holm, BH; ``grouping``: FP8-probe group means; ``simulate``: seeded table generators;
* ``battery`` and ``battery_items``: the entry points; ``items``: per-item frames and paired designs.
"""

from __future__ import annotations

from phaselens.stats.battery import PhaseBattery
from phaselens.stats.battery_counts import phase_battery
from phaselens.stats.battery_items import ItemBattery, phase_battery_items
from phaselens.stats.continuous import ContinuousResult, continuous_phase_tests
from phaselens.stats.folding import fold_counts, folded_gap, residue_gap
from phaselens.stats.gapci import gap_ci, item_gap_ci
from phaselens.stats.grouping import GroupMeans, group_means
from phaselens.stats.intervals import wilson_ci
from phaselens.stats.multiple import benjamini_hochberg, holm
from phaselens.stats.omnibus import chi2_statistic, chi2_test, cmh_test, cochran_q, g_statistic, g_test
from phaselens.stats.outcomes import GapInterval, PermutationResult, TestResult
from phaselens.stats.paired import nested_cochran_q
from phaselens.stats.period import PeriodResult, detect_period, detect_period_paired
from phaselens.stats.periodicity import (
    HarmonicResult,
    harmonic_fraction,
    harmonic_statistic,
    nested_fold_statistic,
    nested_fold_test,
)
from phaselens.stats.published import (
    GateCyclingSummary,
    KnockoutSummary,
    counts_from_accuracy,
    gate_cycling_summary,
    knockout_summary,
)
from phaselens.stats.resampling import gap_permutation_test, within_item_permutation_test

__all__ = [
    "ContinuousResult",
    "GateCyclingSummary",
    "GapInterval",
    "GroupMeans",
    "HarmonicResult",
    "ItemBattery",
    "KnockoutSummary",
    "PeriodResult",
    "PermutationResult",
    "PhaseBattery",
    "TestResult",
    "benjamini_hochberg",
    "chi2_statistic",
    "chi2_test",
    "cmh_test",
    "cochran_q",
    "continuous_phase_tests",
    "counts_from_accuracy",
    "detect_period",
    "detect_period_paired",
    "fold_counts",
    "folded_gap",
    "g_statistic",
    "g_test",
    "gap_ci",
    "gap_permutation_test",
    "gate_cycling_summary",
    "group_means",
    "harmonic_fraction",
    "harmonic_statistic",
    "holm",
    "item_gap_ci",
    "knockout_summary",
    "nested_cochran_q",
    "nested_fold_statistic",
    "nested_fold_test",
    "phase_battery",
    "phase_battery_items",
    "residue_gap",
    "wilson_ci",
    "within_item_permutation_test",
]
