"""Rounding margins of discrete steps (phaselens.core.margins): which rows a float rounding could flip."""

from __future__ import annotations

import torch

from phaselens.core import margins
from phaselens.models.parts.formats import fp4_round_trip, fp8_round_trip


def test_relative_rounding_follows_the_dtype():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert margins.relative_rounding(dtype) == 2 * torch.finfo(dtype).eps


def test_topk_flags_only_rows_whose_kth_and_next_scores_are_within_rounding():
    r = margins.relative_rounding(torch.float32)
    scores = torch.tensor([
        [5.0, 3.0, 1.0, 0.5],  # k=2: 3.0 against 1.0: firm
        [5.0, 2.0, 2.0 * (1 - r / 4), 0.0],  # 2.0 against a value a quarter of the rounding below: fragile
        [5.0, 0.0, 0.0, 0.0],  # an exact tie at zero (the indexer's ReLU): the same on every path
        [5.0, 2.0, float("-inf"), float("-inf")],  # nothing left out to tie with
        [5.0, 2.0, 2.0 * (1 - 4 * r), 0.0],  # four times the rounding apart: firm (in fp32)
    ])
    with margins.recording(5) as rec:
        margins.note_topk(scores, 2)
    assert rec.flags.tolist() == [False, True, False, False, False]
    assert rec.by_kind == {"topk": 1} and rec.decisions == 1
    sorted_scores = scores.sort(-1, descending=True).values
    with margins.recording(5) as again:
        margins.note_topk(sorted_scores, 2, sorted_desc=True)
    assert torch.equal(again.flags, rec.flags)
    with margins.recording(5) as coarse:  # the same gap is within a bf16 rounding
        margins.note_topk(scores, 2, dtype=torch.bfloat16)
    assert coarse.flags.tolist() == [False, True, False, False, True]


def test_rows_may_be_flattened_with_positions():
    scores = torch.zeros(6, 4)  # rows x positions = 2 x 3, flattened
    scores[:, 0] = 1.0
    scores[4, 1], scores[4, 2] = 0.5, 0.5  # row 1, position 1: an exact non-zero tie
    with margins.recording(2) as rec:
        margins.note_topk(scores, 2)
    assert rec.flags.tolist() == [False, True]


def test_fp8_round_trip_flags_values_at_a_rounding_midpoint_or_scale_boundary():
    # one block of 32; amax 300 -> scale 1: E4M3 steps of 2 between 16 and 32, so 17 is a midpoint. An amax
    # just above 448 takes the scale 2 instead of 1, which changes no E4M3 value here (a power-of-two scale
    # shifts exponents only): a decision that changes nothing is not fragile
    x = torch.full((3, 32), 4.0)
    x[:, 0] = 300.0
    x[1, 5] = 17.0 * (1 + 1e-7)  # a rounding of fp32 above the midpoint between 16 and 18
    x[2, 0] = 448.0 * (1 + 1e-7)  # amax just above a power-of-two scale boundary
    with margins.recording(3) as rec:
        out = fp8_round_trip(x, 32)
    assert rec.flags.tolist() == [False, True, False]
    assert torch.equal(out, margins_free(fp8_round_trip, x, 32))  # recording changes nothing computed
    y = torch.full((3, 32), 1.4)  # E2M1: 1.5 with scale 1, 1.0 with scale 2 (0.7 -> 0.5)
    y[:, 0] = 4.0  # amax 4 -> scale 1
    y[1, 3] = 1.25 * (1 + 1e-7)  # the midpoint between E2M1's 1 and 1.5
    y[2, 0] = 6.0 * (1 + 1e-7)  # the scale boundary between 1 and 2, where it changes 1.4's value
    with margins.recording(3) as rec4:
        fp4_round_trip(y, 32)
    assert rec4.flags.tolist() == [False, True, True]


def margins_free(fn, *args):
    with margins.paused():
        return fn(*args)


def test_nothing_is_recorded_without_a_recorder_or_while_paused():
    scores = torch.tensor([[1.0, 1.0, 0.0]])
    margins.note_topk(scores, 1)  # no recorder: nothing happens
    with margins.recording(1) as rec:
        with margins.paused():
            margins.note_topk(scores, 1)
        assert rec.decisions == 0 and not rec.flags.any()
        margins.note_topk(scores, 1)
    assert rec.flags.tolist() == [True] and margins.active() is None
