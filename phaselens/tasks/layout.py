"""Where records and padding go: the records region shared by ``KVRecall`` and ``Needle``.

A region is a run of ``length`` slots starting at ``start`` that holds ``R`` records of ``L`` tokens and
``n_filler`` one-token padding units. Both padding schemes fill the *same* region, so for one task the
sequence length, the query position and the target's design are identical across schemes:

- ``prefix``: the records form a rigid **block** (records plus ``block_filler`` units in a fixed random
  arrangement per base item). Padding before the block moves it so that the target key lands on its designed
  slot; the rest of the padding follows the block. Distractors keep their offsets from the target.
- ``in_sequence``: the target record sits at its designed slot; the records before and after it are spread
  uniformly at random over the slots on their side. Distractor phases decorrelate from the target's.
- ``shared_prefix``: the same rigid block as ``prefix``, but the padding that moves the target goes right
  before the target record instead of before the block. The block's records before the target keep their
  slots at every residue, so the residues of one item share their prompt up to the target: a prefix-caching
  server (vLLM, SGLang) prefills that part once per item, not once per residue. Distractors after the target
  keep their offsets from it; those before it keep their absolute slots.

Units are records or fillers; a row of the arrangement is a boolean vector ``is_record [U]`` with exactly R
``True`` entries, ``U = R + n_filler``. A unit's slot is ``start + u + (L - 1) * (records before u)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phaselens.errors import TaskError
from phaselens.tasks.design import PositionDesign

SCHEMES = ("prefix", "in_sequence", "shared_prefix")


@dataclass(frozen=True)
class RegionPlan:
    """Geometry of a records region (all slots absolute, BOS at slot 0).

    Args:
        start: first slot of the region.
        n_records: R.
        record_len: L, tokens per record.
        key_offset: slot of the designed key token inside a record (0 for a one-token key at the start).
        block_filler: filler units interleaved with the records (inside the rigid block in ``prefix``).
        target_lo, target_hi: the record indices the target may take (inclusive).
        design: where the target key sits; ``design.lowest`` is the first slot every layout can reach.
    """

    start: int
    n_records: int
    record_len: int
    key_offset: int
    block_filler: int
    target_lo: int
    target_hi: int
    design: PositionDesign

    @property
    def pad(self) -> int:
        """Padding units beyond the block filler: enough to reach every designed slot with every target index."""
        return self.design.width + self.record_len * (self.target_hi - self.target_lo) + self.block_filler

    @property
    def n_filler(self) -> int:
        return self.block_filler + self.pad

    @property
    def n_units(self) -> int:
        return self.n_records + self.n_filler

    @property
    def length(self) -> int:
        return self.n_records * self.record_len + self.n_filler

    @property
    def end(self) -> int:
        """One past the last slot of the region."""
        return self.start + self.length


def make_plan(
    *,
    start: int,
    n_records: int,
    record_len: int,
    key_offset: int,
    block_filler: int,
    target_records: tuple[int, int] | None,
    modulus: int,
    n_cycles: int,
    origin: int,
) -> RegionPlan:
    """A region just large enough for both schemes; the design starts at the first slot they can all reach."""
    if target_records is None:
        lo, hi = 0, n_records - 1
    else:
        lo, hi = (int(x) for x in target_records)
        if not 0 <= lo <= hi < n_records:
            raise TaskError(
                f"target_records {target_records!r} must be (lo, hi) with 0 <= lo <= hi < n_records={n_records}."
            )
    # The earliest designed slot must leave room, before the target, for the block filler and `hi` records.
    lowest = start + key_offset + record_len * hi + block_filler
    design = PositionDesign(modulus=modulus, lowest=lowest, n_cycles=n_cycles, origin=origin)
    return RegionPlan(start, n_records, record_len, key_offset, block_filler, lo, hi, design)


def _ranks(keys: np.ndarray) -> np.ndarray:
    """Rank of each entry within its row (0 = smallest): ``[N, U]`` int64."""
    order = np.argsort(keys, axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(keys.shape[1])[None, :].repeat(keys.shape[0], 0), axis=1)
    return ranks


def random_blocks(rng: np.random.Generator, n: int, plan: RegionPlan) -> np.ndarray:
    """Rigid blocks for the prefix scheme: ``is_record [n, R + block_filler]``, R records in random slots."""
    width = plan.n_records + plan.block_filler
    return _ranks(rng.random((n, width))) < plan.n_records


def _record_offsets(is_record: np.ndarray, record_len: int) -> np.ndarray:
    """Slot offset of every unit from the start of its arrangement: ``[N, U]``."""
    before = np.cumsum(is_record, axis=1) - is_record
    return np.arange(is_record.shape[1])[None, :] + (record_len - 1) * before


def arrange_prefix(
    plan: RegionPlan, blocks: np.ndarray, target: np.ndarray, t_key: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Shift each row's block so its target key lands on ``t_key``.

    Args:
        blocks: ``[N, R + block_filler]`` rigid arrangements (one per row; repeat a base item's block for
            the paired design).
        target: ``[N]`` record index of the target; t_key: ``[N]`` designed key slots.

    Returns:
        ``(is_record [N, U], in_block [N, U])``.
    """
    n = blocks.shape[0]
    offsets = _record_offsets(blocks, plan.record_len)
    rec_units = np.sort(np.where(blocks, np.arange(blocks.shape[1])[None, :], blocks.shape[1]), axis=1)
    target_unit = rec_units[np.arange(n), target]
    shift = t_key - plan.key_offset - offsets[np.arange(n), target_unit] - plan.start  # head padding units
    if (shift < 0).any() or (shift > plan.pad).any():
        raise TaskError("internal: a designed slot is unreachable by the prefix block; please report this.")
    idx = np.arange(plan.n_units)[None, :] - shift[:, None]
    in_block = (idx >= 0) & (idx < blocks.shape[1])
    is_record = in_block & np.take_along_axis(blocks, np.clip(idx, 0, blocks.shape[1] - 1), axis=1)
    return is_record, in_block


def arrange_shared_prefix(
    plan: RegionPlan, blocks: np.ndarray, target: np.ndarray, t_key: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The ``prefix`` block with its head padding moved to just before the target record.

    The same arguments and padding counts as :func:`arrange_prefix` (so the target lands on the same
    ``t_key``); units before the target record keep their place at the start of the region.

    Returns:
        ``(is_record [N, U], in_block [N, U])``.
    """
    n, width = blocks.shape
    offsets = _record_offsets(blocks, plan.record_len)
    rec_units = np.sort(np.where(blocks, np.arange(width)[None, :], width), axis=1)
    target_unit = rec_units[np.arange(n), target]
    shift = t_key - plan.key_offset - offsets[np.arange(n), target_unit] - plan.start  # pads before the target
    if (shift < 0).any() or (shift > plan.pad).any():
        raise TaskError("internal: a designed slot is unreachable by the shared-prefix block; please report this.")
    units = np.arange(plan.n_units)[None, :]
    before = units < target_unit[:, None]
    idx = np.where(before, units, units - shift[:, None])  # the block unit each region unit holds
    in_block = before | ((idx >= target_unit[:, None]) & (idx < width))
    is_record = in_block & np.take_along_axis(blocks, np.clip(idx, 0, width - 1), axis=1)
    return is_record, in_block


def arrange_in_sequence(
    plan: RegionPlan, rng: np.random.Generator, target: np.ndarray, t_key: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Put each row's target record at ``t_key`` and scatter the others uniformly on either side.

    Returns:
        ``(is_record [N, U], in_block [N, U])``; ``in_block`` is all False (there is no rigid block).
    """
    n, r, u = target.size, plan.n_records, plan.n_units
    filler_before = t_key - plan.key_offset - plan.start - plan.record_len * target
    tau = target + filler_before  # unit index of the target record
    if (filler_before < 0).any() or (tau + (r - 1 - target) >= u).any():
        raise TaskError("internal: a designed slot leaves no room for the other records; please report this.")
    units = np.arange(u)[None, :]
    segment = (units > tau[:, None]).astype(np.int64) * 2 + (units == tau[:, None])
    ranks = _ranks(segment + rng.random((n, u)))  # segment order first, random order within a segment
    after_rank = ranks - tau[:, None] - 1
    is_record = (
        ((segment == 0) & (ranks < target[:, None]))
        | (segment == 1)
        | ((segment == 2) & (after_rank < (r - 1 - target)[:, None]))
    )
    return is_record, np.zeros_like(is_record)


def unit_slots(plan: RegionPlan, is_record: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(record starts [N, R], filler slots [N, n_filler])`` in ascending order, as absolute slots."""
    n = is_record.shape[0]
    slots = plan.start + _record_offsets(is_record, plan.record_len)
    return slots[is_record].reshape(n, plan.n_records), slots[~is_record].reshape(n, plan.n_filler)


def filler_order(plan: RegionPlan, is_record: np.ndarray, in_block: np.ndarray) -> np.ndarray:
    """Index into a base item's filler stream for each filler slot: ``[N, n_filler]``.

    Block filler (prefix scheme) always takes stream entries ``0 .. block_filler - 1`` in order, so a block is
    the same token string at every residue; the remaining padding takes the following entries in order.
    """
    filler = ~is_record
    in_blk = filler & in_block
    outside = filler & ~in_block
    idx = np.where(
        in_blk,
        np.cumsum(in_blk, axis=1) - 1,
        plan.block_filler * in_block.any(axis=1, keepdims=True) + np.cumsum(outside, axis=1) - 1,
    )
    return idx[filler].reshape(is_record.shape[0], plan.n_filler)
