"""The shape of a run's items, known without building them: how many, how long, at which query slots.

A plan never builds the run's items: :func:`plan_items` builds one item per residue (a query slot depends on the
residue, not on the draw) and scales it to ``n_per_residue``. Tasks lay rows out item-major (one base item at
every residue, then the next), so row ``i`` has the query slot of ``order[i % len(order)]``; a prepared
``TaskBatch`` is its own order. :func:`slot_counts` and :func:`block_slot_counts` count slots from that, in
time that does not grow with the number of items (a plan of 10^12 items is instant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from phaselens.analyses.items import is_batch, prepare_task, select_rows
from phaselens.core.geometry import PhaseSpec
from phaselens.runtime.budget import items_bytes


@dataclass(frozen=True)
class PlannedItems:
    """``n`` items of ``seq_len`` tokens, residues mod ``modulus``; ``order``: the query slot of each row of one
    period of the layout (row ``i`` has ``order[i % len(order)]``); ``items_bytes``: host memory to build
    them (0: they are built already)."""

    n: int
    seq_len: int
    order: tuple[int, ...]
    modulus: int
    items_bytes: int = 0

    @property
    def n_residues(self) -> int:
        return len(self.order)


def shape_of(batch: Any) -> PlannedItems:
    """The :class:`PlannedItems` of a built ``TaskBatch`` (its rows are their own order; nothing to build)."""
    order = tuple(int(q) for q in np.asarray(batch.query_pos.cpu() if hasattr(batch.query_pos, "cpu")
                                             else batch.query_pos).tolist())
    return PlannedItems(len(order), int(batch.tokens.shape[1]), order, int(batch.modulus))


def plan_items(model: Any, task: Any, *, n_per_residue: int, residues: Sequence[int] | None = None,
               phase: Any = None, seed: int = 0, stride: int | None = None) -> tuple[Any, PhaseSpec, PlannedItems]:
    """``(task, spec, items)`` of a run without building its items (the options are checked already)."""
    task, spec, residues, _ = prepare_task(model, task, n_per_residue=n_per_residue, residues=residues, phase=phase,
                                           seed=seed, stride=stride)
    if is_batch(task):
        return task, spec, shape_of(select_rows(task, spec, residues))
    probe = task.build(spec, n_per_residue=1, residues=residues, seed=int(seed))
    n = len(probe) * int(n_per_residue)
    planned = shape_of(probe)
    return task, spec, PlannedItems(n, planned.seq_len, planned.order, planned.modulus, items_bytes(n, planned.seq_len))


def slot_counts(items: PlannedItems) -> list[tuple[int, int]]:
    """``[(query slot, items)]``, by slot."""
    order = np.asarray(items.order, dtype=np.int64)
    full, rest = divmod(items.n, len(order))
    slots, counts = np.unique(order, return_counts=True)
    tail = dict(zip(*np.unique(order[:rest], return_counts=True))) if rest else {}
    return [(int(q), int(c) * full + int(tail.get(q, 0))) for q, c in zip(slots, counts)]


def block_slot_counts(items: PlannedItems, batch_size: int) -> list[tuple[dict[int, int], int]]:
    """``[({query slot: items}, times)]``: the slots of each block of ``batch_size`` consecutive items, each
    distinct block once with how many times it occurs (the layout repeats every ``lcm(len(order),
    batch_size)`` rows)."""
    order = np.asarray(items.order, dtype=np.int64)
    p, bs = len(order), int(batch_size)
    period = math.lcm(p, bs)
    periods, out = items.n // period, []

    def blocks(start: int, stop: int, times: int) -> None:
        for a in range(start, stop, bs):
            slots, counts = np.unique(order[np.arange(a, min(a + bs, stop)) % p], return_counts=True)
            out.append(({int(q): int(c) for q, c in zip(slots, counts)}, times))

    if periods:
        blocks(0, period, periods)
    blocks(periods * period, items.n, 1)
    return out


__all__ = ["PlannedItems", "block_slot_counts", "plan_items", "shape_of", "slot_counts"]
