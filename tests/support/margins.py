"""Rounding margins: where a discrete outcome computed from floats (a correct flag, an argmax, a top-k pick, a
rank) could come out differently on another CPU, and comparisons that respect that.

Float kernels differ between CPUs (AVX2, AVX-512 and the scalar ``default`` path sum in different orders), so
float32 logits move in their last bits from one machine to another. A 0/1 flag or a count derived from them is
the same on every CPU only where the decision it makes is far from a tie. These helpers measure that distance
(the *margin*) in the same run as the comparison, and assert flags exactly where the margin is well above the
rounding, and nowhere else.

``DRIFT``: the largest cross-CPU difference measured on a model-derived fp32 number of order 1-10 (a logit or a
logit difference): 1.1e-5 (tests/test_pinned_numbers.py, two machines), so ``TIE`` = 5e-5 is about 4.5 times it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

DRIFT = 1.1e-5
TIE = 5e-5
MIN_COVERAGE = 0.9  # a margin check must assert on at least this share of what it covers


def decision_margins(logits: torch.Tensor, answer: torch.Tensor, *, outcomes: str = "all") -> np.ndarray:
    """Per row of ``logits`` ``[N, V]``: how far the row is from changing a discrete outcome that
    :func:`~phaselens.analyses.scoring.answer_metrics` derives from it. ``outcomes="correct"``: the correct flag
    (the gap between the answer's logit and the best other logit); ``"all"``: also the rank of the answer and
    the greedy token (the smallest gap between the answer's logit and any other logit, and between the two best
    logits). ``[N]``, in logit units."""
    lg = logits.detach().double().cpu()
    idx = torch.arange(lg.shape[0])
    a = lg[idx, answer.cpu().long()]
    others = lg.clone()
    others[idx, answer.cpu().long()] = float("-inf")
    to_best = (a - others.amax(-1)).abs()
    if outcomes == "correct":
        return to_best.numpy()
    others[idx, answer.cpu().long()] = float("inf")
    to_answer = (others - a[:, None]).abs().amin(-1)
    top2 = lg.topk(min(2, lg.shape[-1]), dim=-1).values
    between_best = top2[:, 0] - top2[:, -1] if lg.shape[-1] > 1 else torch.full_like(a, float("inf"))
    return torch.minimum(torch.minimum(to_answer, between_best), to_best).numpy()


def scored(logits: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor) -> dict[str, np.ndarray]:
    """:func:`~phaselens.analyses.scoring.answer_metrics` of a reference's logits, plus ``margin``: their
    :func:`decision_margins` of the correct flag, for comparing another path's flags with
    :func:`assert_flags_agree`."""
    from phaselens.analyses.scoring import answer_metrics

    return {**answer_metrics(logits, answer, wrong), "margin": decision_margins(logits, answer, outcomes="correct")}


@contextmanager
def recorded_margins(monkeypatch: Any) -> Iterator[list[np.ndarray]]:
    """Record :func:`decision_margins` of every ``answer_metrics`` call made inside the block, in every phaselens
    module that imported it. Yields the list the margins are appended to (one array per call)."""
    from phaselens.analyses import scoring

    original: Callable = scoring.answer_metrics
    seen: list[np.ndarray] = []

    def recording(logits, answer, wrong):
        seen.append(decision_margins(logits, answer))
        return original(logits, answer, wrong)

    for name, module in list(sys.modules.items()):
        if name.startswith("phaselens") and getattr(module, "answer_metrics", None) is original:
            monkeypatch.setattr(module, "answer_metrics", recording)
    yield seen


def assert_flags_agree(got: np.ndarray, pinned: np.ndarray, margins: np.ndarray, *, tie: float = TIE,
                       what: str = "flags") -> float:
    """Discrete outcomes ``got`` equal ``pinned`` wherever the margin is above ``tie``; where it is not, the
    outcome may have flipped on another CPU and is not asserted. Returns the share asserted, which must be at
    least :data:`MIN_COVERAGE`."""
    got, pinned, margins = (np.asarray(x) for x in (got, pinned, margins))
    assert got.shape == pinned.shape == margins.shape, (got.shape, pinned.shape, margins.shape)
    firm = margins > tie
    coverage = float(firm.mean()) if firm.size else 1.0
    assert coverage >= MIN_COVERAGE, f"{what}: only {coverage:.0%} of margins exceed {tie:g}: the check says little"
    bad = np.flatnonzero(firm & (got != pinned))
    assert not bad.size, (f"{what}: {bad.size} outcomes with margins above {tie:g} changed, first at {bad[0]}: "
                          f"pinned {pinned[bad[0]]!r}, now {got[bad[0]]!r} (margin {margins[bad[0]]:.3g})")
    return coverage
