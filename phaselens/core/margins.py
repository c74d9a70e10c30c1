"""Rounding margins of discrete steps: which rows took a decision within the dtype's rounding of flipping.

Two computations of one value by different paths differ in their last bits: a query-suffix pass of ``C x n``
rows and a forward of ``n`` rows, cached decoding and a parallel forward, or one CPU and another (AVX2, AVX-512
and the scalar kernels sum in different orders). A discrete step taken from such a value (the indexer's top-k,
the MoE router's top-k, the rounding of an activation to FP8 or FP4) decides alike on both paths only when the
value is farther from the decision's boundary than that difference. Where it is not, the two paths can disagree
by a whole pick or a whole quantization step, and so can two machines: that is real for users, not a bug of
either path.

While a :class:`MarginRecorder` is active (:func:`recording`), the model's discrete steps report here, and each
row of the computation (an item, or a cell's copy of an item in a suffix-engine pass) is flagged when one of its
decisions had a margin below the dtype's rounding (:func:`relative_rounding`: two units in the last place):

* top-k (:func:`note_topk`): the gap between the k-th and the (k+1)-th best finite score, relative to the
  largest of the row's best and the two scores' magnitudes;
* a round trip through a low-precision format (:func:`note_round_trip`): the round trip of the values scaled by
  ``1 - r`` and ``1 + r`` differs from the round trip taken (a value near a rounding midpoint, or a block's
  maximum near a scale boundary that changes a value).

The flags count the decisions that a last-bit difference flips. Two paths can differ by more than that where a
value is the small difference of large terms (measured on the tiny V4.1 between the engine and a forward in
fp32: median 2, 99th percentile 280 units in the last place), so the count is a lower bound on the rows at risk,
not a proof that the others agree: exact comparisons of two paths belong in fp64 (docs/testing.md).

With no recorder active every ``note_*`` returns at once. Leading dimensions of what is noted must be the rows
(``[rows, ...]`` or ``[rows * pos, ...]``, row-major), as every activation of a forward is, or tokens gathered
from them (:func:`gathered`: a MoE expert's tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

ULPS = 2  # "below the dtype's rounding": within two units in the last place


def relative_rounding(dtype: torch.dtype) -> float:
    """The dtype's rounding, relative: :data:`ULPS` units in the last place (``2 * eps``)."""
    return ULPS * torch.finfo(dtype).eps


@dataclass
class MarginRecorder:
    """Flags per row: ``flags`` ``[rows]`` (bool), set where a decision's margin was below the rounding;
    ``by_kind`` counts flagged decisions (``"topk"``, ``"round_trip"``); ``decisions`` counts notes."""

    rows: int
    device: torch.device | None = None
    flags: Tensor = field(init=False)
    by_kind: dict[str, int] = field(default_factory=dict)
    decisions: int = 0

    def __post_init__(self) -> None:
        self.flags = torch.zeros(self.rows, dtype=torch.bool, device=self.device)

    def note(self, kind: str, fragile: Tensor) -> None:
        """``fragile``: bool with the rows as its leading (possibly flattened with positions) elements, or,
        inside :func:`gathered`, with the gathered tokens as its leading dimension."""
        self.decisions += 1
        if fragile.numel() == 0:
            return
        where = _GATHERED.get()
        if where is not None:  # tokens gathered from the [rows * pos] flattened tokens: scatter them back
            index, n_tokens = where
            per_token = torch.zeros(n_tokens, dtype=torch.bool, device=fragile.device)
            per_token[index] = fragile.reshape(len(index), -1).any(-1)
            fragile = per_token
        per_row = fragile.reshape(self.rows, -1).any(-1).to(self.flags.device)
        if bool(per_row.any()):
            self.flags |= per_row
            self.by_kind[kind] = self.by_kind.get(kind, 0) + int(fragile.sum())


_ACTIVE: ContextVar[MarginRecorder | None] = ContextVar("phaselens_margin_recorder", default=None)
_GATHERED: ContextVar[tuple[Tensor, int] | None] = ContextVar("phaselens_margin_gathered", default=None)


@contextmanager
def recording(rows: int, device: torch.device | None = None) -> Iterator[MarginRecorder]:
    """Record the margins of every discrete step inside the block for a computation of ``rows`` rows."""
    rec = MarginRecorder(int(rows), device)
    with _set(_ACTIVE, rec):
        yield rec


def paused() -> AbstractContextManager[None]:
    """No recording inside the block (a side computation whose rows are not the recorder's)."""
    return _set(_ACTIVE, None)


def gathered(index: Tensor, n_tokens: int) -> AbstractContextManager[None]:
    """Inside the block, noted tensors lead with tokens ``index`` ``[m]`` gathered from ``n_tokens`` flattened
    ``[rows * pos]`` tokens (a MoE expert's share of them)."""
    return _set(_GATHERED, (index, int(n_tokens)))


@contextmanager
def _set(var: ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def active() -> MarginRecorder | None:
    return _ACTIVE.get()


def note_topk(values: Tensor, k: int, *, sorted_desc: bool = False, dtype: torch.dtype | None = None) -> None:
    """A top-``k`` along the last axis of ``values`` ``[..., E]`` (``-inf``: not a candidate); with
    ``sorted_desc`` the values are already sorted best first (the full sort, not just ``k``). ``dtype``: the
    dtype whose rounding the values carry (default theirs; a router scoring bf16 activations in fp32 passes
    bf16). Exact ties at zero (the ReLU of the indexer zeroes whole rows on every path) are not fragile."""
    rec = _ACTIVE.get()
    if rec is None or k <= 0 or values.shape[-1] <= k:
        return
    top = values if sorted_desc else values.topk(k + 1, dim=-1).values
    inside, outside = top[..., k - 1].float(), top[..., k].float()
    scale = torch.maximum(torch.maximum(inside.abs(), outside.abs()), top[..., 0].float().abs())
    decided = torch.isfinite(inside) & torch.isfinite(outside) & ((inside != 0) | (outside != 0))
    rec.note("topk", decided & (inside - outside <= scale * relative_rounding(dtype or values.dtype)))


def note_round_trip(round_trip: Callable[[Tensor], Tensor], x: Tensor, out: Tensor) -> None:
    """``out = round_trip(x)`` (elementwise decisions over blocks of the last axis): flags elements whose round
    trip changes when ``x`` moves by its relative rounding either way."""
    rec = _ACTIVE.get()
    if rec is None:
        return
    r = relative_rounding(x.dtype)
    wide = x.float()
    moved = (round_trip((wide * (1 - r)).to(x.dtype)) != out) | (round_trip((wide * (1 + r)).to(x.dtype)) != out)
    rec.note("round_trip", moved)


def cell_margins(fragile: np.ndarray, dtype: torch.dtype | None) -> dict[str, Any] | None:
    """A map's ``metadata["rounding_margins"]`` from ``fragile`` ``[cells, items]`` (1.0 / 0.0, NaN where not
    measured): how many cells had an item whose clean prefix or intervened query row took a decision within the
    dtype's rounding of flipping (their numbers can differ by a whole pick or quantization step between the
    engine and full forwards, or between two CPUs). ``None``: not measured (full forwards, or an engine that
    does not measure margins)."""
    if fragile.size == 0 or np.isnan(fragile).any():
        return None
    return {"cells_fragile": int(fragile.any(axis=1).sum()), "cells": int(fragile.shape[0]),
            "cell_items_fragile": int(fragile.sum()), "items": int(fragile.shape[1]),
            "relative_rounding": None if dtype is None else relative_rounding(dtype)}


__all__ = ["MarginRecorder", "cell_margins", "active", "gathered", "note_round_trip", "note_topk", "paused", "recording", "relative_rounding"]
