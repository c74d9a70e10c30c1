"""Drawing and placing the records of one batch: the steps ``KVRecall`` and ``Needle`` share.

Both tasks hold R records with distinct keys and values, pick a target record and its neighbour (the
distractor whose value is the ``wrong`` answer), demonstrate ``n_demos`` other records, and place the
target key on its designed slot inside a records region (:mod:`phaselens.tasks.layout`). They differ only in
what a record is made of (one token each, or text pieces) and so in how the token rows are written.

The random draws happen in one fixed order (keys, values, target, demos, [the caller's own draws], blocks,
design, in-sequence arrangement), so a seed gives the same items as it always has.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import ResourceError, TaskError
from phaselens.tasks import layout
from phaselens.tasks.design import PositionDesign
from phaselens.tasks.residues import check_count, check_modulus, check_residues, expand_items, geometry_frame

# Peak bytes per item token while a task builds its items (token ids, the corrupted twin, int64 scratch);
# measured, see runtime/budget.py, which prices analyses with it.
BUILD_BYTES_PER_TOKEN = 56


def machine_memory() -> int | None:
    """Bytes of memory this machine has (its physical memory, capped by a cgroup v2 limit); ``None``: unknown.
    No build larger than this can ever run, so a build refused against it is refused for certain."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        return min(total, int(text)) if text.isdigit() else total
    except (OSError, ValueError):
        return total


def check_build_size(task: Any, spec: PhaseSpec | None, n_items: int, n_residues: int,
                     count: str = "n_per_residue") -> None:
    """Refuse (:class:`ResourceError`) ``n_items`` items of ``task.seq_len(spec)`` tokens that need more than
    this machine's memory, before a row is allocated; the message names the largest ``count`` (items per
    residue, or a training ``batch_size`` with ``n_residues=1``) and ``block_filler`` that fit (a huge
    ``block_filler`` asked for hundreds of GiB)."""
    T, mem = int(task.seq_len(spec)), machine_memory()
    need = n_items * BUILD_BYTES_PER_TOKEN * T
    if mem is None or need <= mem:
        return
    per_residue = mem // (BUILD_BYTES_PER_TOKEN * T * n_residues)  # items of T tokens per residue that fit
    fix = [f"{count}={per_residue:,}"] if per_residue else []
    per_item = mem // (BUILD_BYTES_PER_TOKEN * n_items)  # tokens of one item that fit, at this many items
    bf = int(getattr(task, "block_filler", 0))
    lo, hi = 0, bf  # the largest block_filler whose items fit (seq_len grows with it)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(dataclasses.replace(task, block_filler=mid).seq_len(spec)) <= per_item else (lo, mid - 1)
    if bf and int(dataclasses.replace(task, block_filler=lo).seq_len(spec)) <= per_item:
        fix.append(f"block_filler={lo:,}")
    raise ResourceError(
        f"{type(task).__name__}: {n_items:,} items of {T:,} tokens need about {need / 2**30:,.1f} GiB to build, "
        f"more than this machine's {mem / 2**30:,.1f} GiB of memory; "
        + (f"use {' or '.join(fix)} or less." if fix else "shorten the task (fewer records or demos).")
    )


@dataclass(frozen=True)
class RecordDraw:
    """Per base item: which records it holds and which of them the query and the demos use.

    Attributes:
        keys, values: ``[n_base, R]`` indices into the key and value pools (distinct within a row).
        target: ``[n_base]`` the target record's index; ``neighbour``: ``[n_base]`` the distractor record
            (the next record, the previous one when the target is last).
        demos: ``[n_base, n_demos]`` record indices demonstrated (never the target or the distractor).
    """

    keys: np.ndarray
    values: np.ndarray
    target: np.ndarray
    neighbour: np.ndarray
    demos: np.ndarray


@dataclass(frozen=True)
class Placement:
    """Per row: where the target key sits and where every unit of the region goes.

    Attributes:
        t_key: ``[N]`` the target key's slot (its designed slot at the row's residue).
        target: ``[N]`` the target record index of the row's base item.
        is_record: ``[N, U]`` which units of the region are records; ``in_block``: ``[N, U]`` which fillers
            sit inside the rigid block (``prefix`` padding; all False for ``in_sequence``).
        starts: ``[N, R]`` first slot of each record; ``fill_slots``: ``[N, n_filler]`` slots of the fillers.
    """

    t_key: np.ndarray
    target: np.ndarray
    is_record: np.ndarray
    in_block: np.ndarray
    starts: np.ndarray
    fill_slots: np.ndarray


def check_records(padding: str, n_records: int, n_keys: int, n_values: int, n_demos: int) -> None:
    """Validate the settings both tasks share (pools large enough for R distinct keys and values; demos that
    skip the target and the distractor)."""
    if padding not in layout.SCHEMES:
        raise TaskError(f"padding must be one of {layout.SCHEMES}, got {padding!r}.")
    if n_records > min(n_keys, n_values):
        raise TaskError(f"n_records={n_records} needs as many distinct keys and values; the pools hold "
                        f"{n_keys} keys and {n_values} values.")
    if n_demos > n_records - 2:
        raise TaskError(f"n_demos={n_demos} exceeds n_records - 2 = {n_records - 2} (demos skip the target "
                        "and the distractor record).")


def draw_records(rng: np.random.Generator, n_base: int, plan: layout.RegionPlan, n_keys: int, n_values: int,
                 n_demos: int) -> RecordDraw:
    """Each base item's records, target, distractor and demos (the first draws from ``rng``)."""
    r = plan.n_records
    keys = np.argsort(rng.random((n_base, n_keys)), axis=1)[:, :r]
    values = np.argsort(rng.random((n_base, n_values)), axis=1)[:, :r]
    target = rng.integers(plan.target_lo, plan.target_hi + 1, n_base)
    neighbour = np.where(target < r - 1, target + 1, target - 1)
    pick = rng.random((n_base, r))
    rows = np.arange(n_base)
    pick[rows, target] = pick[rows, neighbour] = 2.0  # never demonstrated
    demos = np.argsort(pick, axis=1)[:, :n_demos]
    return RecordDraw(keys, values, target, neighbour, demos)


def place_records(rng: np.random.Generator, plan: layout.RegionPlan, padding: str, n_base: int, base: np.ndarray,
                  residues: np.ndarray, target: np.ndarray) -> Placement:
    """Place row i's target key (base item ``base[i]``) at residue ``residues[i]`` and arrange the region.

    Args:
        base: ``[N]`` base item of each row; residues: ``[N]`` its residue; target: ``[n_base]`` target records.
    """
    blocks = layout.random_blocks(rng, n_base, plan) if padding in ("prefix", "shared_prefix") else None
    z, v = plan.design.draw(rng, n_base)
    t_key = plan.design.place(residues, z[base], v[base])
    tgt = target[base]
    if blocks is not None:
        arrange = layout.arrange_shared_prefix if padding == "shared_prefix" else layout.arrange_prefix
        is_record, in_block = arrange(plan, blocks[base], tgt, t_key)
    else:
        is_record, in_block = layout.arrange_in_sequence(plan, rng, tgt, t_key)
    starts, fill_slots = layout.unit_slots(plan, is_record)
    if not np.array_equal(starts[np.arange(base.size), tgt] + plan.key_offset, t_key):
        raise TaskError("internal: the target record is not at its designed slot; please report this.")
    return Placement(t_key, tgt, is_record, in_block, starts, fill_slots)


@dataclass(frozen=True)
class Rows:
    """The rows of one build: ``modulus``, the region ``plan``, base item and residue per row, base items."""

    modulus: int
    plan: layout.RegionPlan
    base: np.ndarray
    residues: np.ndarray
    n_base: int


class RecordsTask:
    """What ``KVRecall`` and ``Needle`` share beyond the draws: the design accessors, the rows of a build and
    the per-item frame. The class provides ``plan(spec)`` and the fields ``modulus`` and ``paired``."""

    modulus: Any
    paired: bool

    def plan(self, spec: PhaseSpec | None = None) -> layout.RegionPlan:  # pragma: no cover - each task's own
        raise NotImplementedError

    def design(self, spec: PhaseSpec | None = None) -> PositionDesign:
        """The target-key design (slots of t_K per residue)."""
        return self.plan(spec).design

    def design_pmf(self, residue: int, spec: PhaseSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact pmf of t_K at ``residue``: ``(support [n] int64, probabilities [n] float64)``."""
        return self.design(spec).pmf(residue)

    def _rows(self, spec: PhaseSpec, n_per_residue: int, residues: Sequence[int] | None) -> Rows:
        """Validate a build's arguments and lay out its rows (item-major when paired)."""
        modulus = check_modulus(spec, self.modulus)
        res = check_residues(residues, modulus)
        n = check_count(n_per_residue)
        plan = self.plan(spec)
        check_build_size(self, spec, n * len(res), len(res))
        base, row_res, n_base = expand_items(n, res, self.paired)
        return Rows(modulus, plan, base, row_res, n_base)

    @staticmethod
    def _frame(spec: PhaseSpec, rows: Rows, t_key: np.ndarray, t_value: np.ndarray, target: np.ndarray,
               seq_len: int) -> pd.DataFrame:
        """The per-item frame: geometry (residue, phase, slots) plus ``target_index`` and ``distance``."""
        frame = geometry_frame(spec, rows.modulus, item_id=rows.base, t_key=t_key, t_value=t_value,
                               query_pos=np.full(rows.base.size, seq_len - 1))
        frame["target_index"] = target
        frame["distance"] = seq_len - 1 - t_key
        return frame
