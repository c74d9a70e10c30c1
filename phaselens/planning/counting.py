"""Model calls and token passes of a run, counted from what its analysis declares (:class:`Units`).

Counts follow the engines exactly (``tests/planning/test_run_plans.py`` counts real runs of every analysis):

* calibration (mean and resample knockouts): ``ceil(items / calibration_batch)`` forwards of the task's length;
* every full pass (``item_passes``, and each cell with ``engine="full"``): ``ceil(N / batch_size)`` forwards of
  ``batch_size`` items of ``T`` tokens (plus ``extra_tokens``), times the model's copies and the pass's own
  ``copies`` (a phase ensemble's shifted copies, phase repair's);
* the query-suffix engine: per query slot ``q`` and piece of ``n <= batch_size`` of its items (over all the items,
  or per block of ``batch_size`` items), one prefill of ``q`` tokens per item (a chunked adapter makes it in
  ``ceil(q / chunk)`` pieces; counted once) and one clean query step; then per call of ``cells_per_call``
  cells and per layer, ``ceil(cells / (rows_per_pass // n))`` passes of the query rows through the layers at and
  above the layer (the DeepSeek-V4 adapter may split a pass further to stay within its ``pass_bytes``).

``token_passes`` counts token rows through the whole model (a query row from layer ``l`` of ``L`` counts
``(L - l) / L``); ``full_forwards`` divides it by ``items x T``: the run's cost in full forwards over the items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phaselens.analyses.units import Units
from phaselens.planning.planned_items import PlannedItems, block_slot_counts, slot_counts

Group = tuple[int, int, int]  # (query slot, rows, times): a slot engine's piece of items, how many alike


@dataclass(frozen=True)
class Counts:
    """What :func:`count` returns: model calls and token passes (calibration included), and the suffix engine's
    groups (``[[(slot, rows, times)]]``: one list per distinct scope, all the items or one block, with how many
    times that scope occurs)."""

    forwards: int
    token_passes: float
    calibration_forwards: int
    calibration_token_passes: float
    groups: list[tuple[list[Group], int]]


def groups_of(slots: list[tuple[int, int]], batch_size: int) -> list[Group]:
    """``(query slot, rows, times)`` of the engine's groups: each slot's rows in pieces of at most
    ``batch_size`` (``times`` pieces of that size; counted, not listed)."""
    out = []
    for q, n in slots:
        full, rest = divmod(int(n), int(batch_size))
        if full:
            out.append((int(q), int(batch_size), full))
        if rest:
            out.append((int(q), rest, 1))
    return out


def count(units: Units, items: PlannedItems, *, batch_size: int, n_layers: int, copies: int = 1) -> Counts:
    """The :class:`Counts` of ``units`` over ``items`` (``copies``: the model's forwards per input)."""
    N, T, L = items.n, items.seq_len, n_layers
    n_cal = units.calibration_items
    forwards = cal_forwards = math.ceil(n_cal / units.calibration_batch)
    tokens = cal_tokens = float(n_cal * T * copies)
    passes = units.item_passes + (units.n_cells if units.engine == "full" else 0)
    forwards += passes * math.ceil(N / batch_size)
    tokens += passes * N * (T + units.extra_tokens) * copies * units.copies
    scopes: list[tuple[list[Group], int]] = []
    if units.engine == "suffix":
        if units.engine_scope == "items":
            scopes = [(groups_of(slot_counts(items), batch_size), 1)]
        else:
            scopes = [(groups_of(sorted(block.items()), batch_size), times)
                      for block, times in block_slot_counts(items, batch_size)]
        layers = list(units.cell_layers)
        per_call = units.cells_per_call
        for groups, scope_times in scopes:
            for q, n, times in groups:
                times *= scope_times
                per_pass = max(1, units.rows_per_pass // n)  # the slot engine: cells per pass of one layer
                forwards += times * ((1 if q > 0 else 0) + 1)  # the prefix prefill, the clean query step
                tokens += times * n * (q + 1)
                for j in range(0, len(layers), per_call):
                    in_call = layers[j : j + per_call]
                    forwards += times * sum(math.ceil(in_call.count(layer) / per_pass) for layer in set(in_call))
        tokens += sum(N * (L - layer) / L for layer in layers)
    return Counts(int(forwards), tokens, cal_forwards, cal_tokens, scopes)


__all__ = ["Counts", "Group", "count", "groups_of"]
