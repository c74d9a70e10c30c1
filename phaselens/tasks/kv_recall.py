"""``KVRecall``: token-level key -> value recall with the target's phase under control.

One item (ids, left to right)::

    BOS | region: R records "key value" + filler | tail filler | n_demos x (QUERY key value) | QUERY target_key

The model must predict the target key's value at the last position. The region is laid out by
:mod:`phaselens.tasks.layout` so that the target key sits at a designed slot (:mod:`phaselens.tasks.design`):
the query position is fixed and E[t_K], Var[t_K] are equal across residues, for both padding schemes.

Vocabulary (``vocab_size = 3 + n_keys + n_values + n_filler``, 128 with the defaults)::

    0 PAD | 1 BOS | 2 QUERY | keys 3.. | values .. | filler ..
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import ResidueError
from phaselens.tasks import layout
from phaselens.tasks.batch import TaskBatch, as_long
from phaselens.tasks.lm_batches import TrainingBatch, numpy_rng
from phaselens.tasks.placement import (
    RecordsTask,
    check_build_size,
    check_records,
    draw_records,
    place_records,
)
from phaselens.tasks.residues import (
    check_modulus,
    check_positive,
    check_seed,
    check_target_records,
    set_flag,
    set_ints,
)
from phaselens.tasks.serialization import SerializableTask, register_task

PAD_ID, BOS_ID, QUERY_ID = 0, 1, 2


@register_task
@dataclass(frozen=True)
class KVRecall(RecordsTask, SerializableTask):
    """Single-token key -> value recall among R records, with demonstrations.

    Args:
        n_records: R records (distinct keys, distinct values) per item.
        n_demos: demonstrations ``QUERY key value`` before the final query; their keys are other records'
            (never the target's, never the distractor record's).
        block_filler: filler tokens interleaved with the records (density knob). In the prefix scheme they
            stay inside the rigid records block.
        min_distance: every target value sits at least this many slots before the query position, so a query
            that attends the last ``w <= min_distance`` raw tokens can reach the target only through
            compressed entries.
        target_records: ``(lo, hi)`` inclusive range of record indices the target may take (None = all).
            With ``hi`` small the target is early and many records follow it; with ``lo`` large it is recent.
        modulus: M, the residue period; a multiple of every stride you evaluate (24 covers S = 2, 3, 4, 6,
            8, 12).
        n_cycles: K, the spread of the target position in whole cycles of M (see ``PositionDesign``).
        padding: ``"prefix"`` (records shift together), ``"in_sequence"`` (record gaps vary) or
            ``"shared_prefix"`` (the padding sits right before the target: residues share a prompt prefix).
        paired: place every base item at every requested residue (shared ``item_id``).
        n_keys, n_values, n_filler: sizes of the three vocabulary blocks.
    """

    kind: ClassVar[str] = "kv_recall"

    n_records: int = 16
    n_demos: int = 4
    block_filler: int = 16
    min_distance: int = 16
    target_records: tuple[int, int] | None = None
    modulus: int = 24
    n_cycles: int = 1
    padding: str = "prefix"
    paired: bool = False
    n_keys: int = 48
    n_values: int = 48
    n_filler: int = 29

    def __post_init__(self) -> None:
        set_ints(self, {"n_records": 2, "n_demos": 0, "block_filler": 0, "min_distance": 0, "n_keys": 1,
                        "n_values": 1, "n_filler": 1, "n_cycles": 1})
        if isinstance(self.modulus, bool) or not isinstance(self.modulus, int | np.integer) or self.modulus < 1:
            raise ResidueError(f"modulus must be a positive integer, got {self.modulus!r}.")
        object.__setattr__(self, "modulus", int(self.modulus))
        set_flag(self, "paired")
        check_records(self.padding, self.n_records, self.n_keys, self.n_values, self.n_demos)
        object.__setattr__(self, "target_records", check_target_records(self.target_records))
        self.plan()  # validates target_records' range

    # ---- vocabulary --------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def query_id(self) -> int:
        return QUERY_ID

    @property
    def key_ids(self) -> range:
        return range(3, 3 + self.n_keys)

    @property
    def value_ids(self) -> range:
        return range(self.key_ids.stop, self.key_ids.stop + self.n_values)

    @property
    def filler_ids(self) -> range:
        return range(self.value_ids.stop, self.value_ids.stop + self.n_filler)

    @property
    def vocab_size(self) -> int:
        return self.filler_ids.stop

    # ---- geometry ----------------------------------------------------------------------------------
    def plan(self, spec: PhaseSpec | None = None) -> layout.RegionPlan:
        """The records region (starts right after BOS) for ``spec``'s origin."""
        return layout.make_plan(
            start=1,
            n_records=self.n_records,
            record_len=2,
            key_offset=0,
            block_filler=self.block_filler,
            target_records=self.target_records,
            modulus=self.modulus,
            n_cycles=self.n_cycles,
            origin=spec.origin if spec is not None else 0,
        )

    def _tail(self, plan: layout.RegionPlan) -> int:
        """Filler between the region and the demos that keeps every target value ``min_distance`` away."""
        query_without_tail = plan.end + 3 * self.n_demos + 1
        return max(0, self.min_distance - (query_without_tail - (plan.design.highest + 1)))

    def seq_len(self, spec: PhaseSpec | None = None) -> int:
        """T, the length of every item (the query sits at T - 1). Independent of the stride."""
        plan = self.plan(spec)
        return plan.end + self._tail(plan) + 3 * self.n_demos + 2

    # ---- assembly ----------------------------------------------------------------------------------
    def _assemble(
        self,
        plan: layout.RegionPlan,
        rng: np.random.Generator,
        base: np.ndarray,
        residues: np.ndarray,
        n_base: int,
    ) -> dict[str, np.ndarray]:
        """Token arrays for rows ``base [N]`` (base item per row) placed at ``residues [N]``."""
        d = self.n_demos
        tail = self._tail(plan)
        # Base content: everything that a paired design keeps fixed across residues.
        rec = draw_records(rng, n_base, plan, self.n_keys, self.n_values, d)
        keys, values = rec.keys + self.key_ids.start, rec.values + self.value_ids.start
        stream = rng.integers(self.filler_ids.start, self.filler_ids.stop, (n_base, plan.n_filler + tail))
        # Rows: place each base item's target at its residue.
        pl = place_records(rng, plan, self.padding, n_base, base, residues, rec.target)
        t_key, tgt, starts, fill_slots = pl.t_key, pl.target, pl.starts, pl.fill_slots
        fill_idx = layout.filler_order(plan, pl.is_record, pl.in_block)

        n = base.size
        t = plan.end + tail + 3 * d + 2
        rows = np.arange(n)[:, None]
        tokens = np.empty((n, t), dtype=np.int64)
        tokens[:, 0] = BOS_ID
        tokens[rows, fill_slots] = stream[base[:, None], fill_idx]
        tokens[:, plan.end : plan.end + tail] = stream[base, plan.n_filler :]
        tokens[rows, starts] = keys[base]
        tokens[rows, starts + 1] = values[base]
        demo_at = plan.end + tail + 3 * np.arange(d)
        tokens[:, demo_at] = QUERY_ID
        tokens[:, demo_at + 1] = np.take_along_axis(keys, rec.demos, 1)[base]
        tokens[:, demo_at + 2] = np.take_along_axis(values, rec.demos, 1)[base]
        tokens[:, t - 2] = QUERY_ID
        tokens[:, t - 1] = keys[base, tgt]
        return {
            "tokens": tokens,
            "t_key": t_key,
            "target": tgt,
            "key": keys[base, tgt],
            "answer": values[base, tgt],
            "wrong": values[base, rec.neighbour[base]],
            "demo_pos": np.broadcast_to(demo_at + 1, (n, d)),
        }

    def build(
        self, spec: PhaseSpec, *, n_per_residue: int, residues: Sequence[int] | None = None, seed: int = 0
    ) -> TaskBatch:
        """Items for ``spec`` at each requested residue (default all of 0..M-1).

        Returns a :class:`TaskBatch` with ``N = n_per_residue * len(residues)`` rows, all of length
        :meth:`seq_len`. Paired: ``n_per_residue`` base items, each at every residue (rows item-major).
        """
        rows = self._rows(spec, n_per_residue, residues)
        base = rows.base
        a = self._assemble(rows.plan, np.random.default_rng(check_seed(seed)), base, rows.residues, rows.n_base)
        t = a["tokens"].shape[1]
        corrupted = a["tokens"].copy()
        corrupted[np.arange(base.size), a["t_key"] + 1] = a["wrong"]
        frame = self._frame(spec, rows, a["t_key"], a["t_key"] + 1, a["target"], t)
        frame["key"] = a["key"]
        frame["answer"] = a["answer"]
        frame["wrong"] = a["wrong"]
        return TaskBatch(
            tokens=as_long(a["tokens"]),
            lengths=torch.full((base.size,), t, dtype=torch.long),
            query_pos=torch.full((base.size,), t - 1, dtype=torch.long),
            answer=as_long(a["answer"]),
            wrong=as_long(a["wrong"]),
            corrupted=as_long(corrupted),
            frame=frame,
            spec=spec,
            modulus=rows.modulus,
            pad_id=PAD_ID,
            task=f"kv_recall/{self.padding}{'/paired' if self.paired else ''}",
        )

    # ---- training ----------------------------------------------------------------------------------
    def sample_training_batch(
        self,
        batch_size: int,
        generator: torch.Generator | np.random.Generator | int | None = None,
        spec: PhaseSpec | None = None,
        *,
        train_on_demos: bool = True,
    ) -> TrainingBatch:
        """A training batch from the same family as :meth:`build`, at uniformly random residues.

        The loss mask covers (a) the last position, whose target is the answer (the target's value), and
        (b) if ``train_on_demos``, each demonstration's key position, whose target is that demo's value.
        Records, filler and query markers are never trained on: their next tokens are random by design.

        Args:
            batch_size: B.
            generator: a ``torch.Generator`` (advanced by one draw), a NumPy Generator, an int seed, or
                None for fresh entropy.
            spec: only its origin matters (residues count from it); its stride must divide M.

        Returns:
            :class:`TrainingBatch` with ``tokens [B, T]``, ``targets [B, T]`` (-100 off the mask) and
            ``loss_mask [B, T]``.
        """
        check_positive("batch_size", batch_size, 1)
        if spec is not None:
            check_modulus(spec, self.modulus)
        check_build_size(self, spec, int(batch_size), 1, "batch_size")
        rng = numpy_rng(generator)
        plan = self.plan(spec)
        residues = rng.integers(0, self.modulus, batch_size)
        a = self._assemble(plan, rng, np.arange(batch_size), residues, batch_size)
        tokens = a["tokens"]
        b, t = tokens.shape
        mask = np.zeros((b, t), dtype=bool)
        targets = np.full((b, t), -100, dtype=np.int64)
        if train_on_demos and self.n_demos:
            dp = a["demo_pos"]
            mask[np.arange(b)[:, None], dp] = True
            targets[np.arange(b)[:, None], dp] = np.take_along_axis(tokens, dp + 1, 1)
        mask[:, t - 1] = True
        targets[:, t - 1] = a["answer"]
        return TrainingBatch(
            tokens=as_long(tokens),
            targets=as_long(targets),
            loss_mask=torch.as_tensor(mask),
            residue=as_long(residues),
            t_key=as_long(a["t_key"]),
        )

    # ---- display -----------------------------------------------------------------------------------
    def render(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Readable symbols for one sequence: ``B`` BOS, ``Q`` query, ``k<i>``, ``v<i>``, ``.`` filler, ``_`` pad."""
        out = []
        for x in ids.tolist() if isinstance(ids, torch.Tensor) else list(ids):
            if x in self.key_ids:
                out.append(f"k{x - self.key_ids.start}")
            elif x in self.value_ids:
                out.append(f"v{x - self.value_ids.start}")
            elif x in self.filler_ids:
                out.append(".")
            else:
                out.append({PAD_ID: "_", BOS_ID: "B", QUERY_ID: "Q"}.get(x, f"?{x}"))
        return " ".join(out)
