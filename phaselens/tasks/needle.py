"""``Needle``: key -> value lookup for any HF tokenizer, with the target's phase under control.

One item (text pieces, tokenised piece by piece; positions are slots in the *full* id sequence)::

    prefix_ids (BOS / chat template) | intro | region: R records + pad units | tail pad units
    | n_demos x (query_prefix record) | query_prefix record-up-to-value(target key)

A record is ``record_template`` with ``{key}`` and ``{value}`` filled, e.g. ``" cat: Alice."``; every record has
the same number of tokens. The answer is the first token of the target's value; ``wrong`` is the first token
of the value of the next record (the previous one when the target is last). ``t_K`` is the slot of the key's
last token, ``t_V`` the slot of the value's first token.

The region is laid out exactly as for ``KVRecall`` (:mod:`phaselens.tasks.layout`); the padding is a
single-token ``pad_unit`` that :mod:`phaselens.tasks.text` checks at build time on the assembled text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import TaskError
from phaselens.tasks import layout
from phaselens.tasks.batch import TaskBatch, as_long
from phaselens.tasks.placement import RecordsTask, check_records, draw_records, place_records
from phaselens.tasks.records import DEFAULT_KEYS, DEFAULT_VALUES, CompiledRecords, split_template, word_pool
from phaselens.tasks.residues import (
    check_ids,
    check_modulus,
    check_seed,
    check_target_records,
    set_flag,
    set_ints,
)
from phaselens.tasks.serialization import SerializableTask, register_task
from phaselens.tasks.text import (
    Piece,
    UnitPadded,
    check_pad_site,
    default_pad_id,
    piece,
    special_prefix,
    unit_id,
    verify_pieces,
)


@register_task
@dataclass(frozen=True)
class Needle(UnitPadded, RecordsTask, SerializableTask):
    """Needle-in-a-haystack lookup over fixed-length text records.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (not serialised; pass it to
            ``from_dict``).
        keys, values: word pools; a record draws R distinct keys and R distinct values. Each pool's words
            must have one token count, and values distinct first tokens.
        record_template: text with ``{key}`` and ``{value}``; whitespace before a slot goes with the slot.
        intro: text right after ``prefix_ids``. query_prefix: text before each demo and the final query.
        pad_unit: the one-token padding unit (checked at build time; PaddingError names the seam).
        n_records, n_demos, block_filler, min_distance, target_records, n_cycles, padding, paired: as for
            ``KVRecall`` (``block_filler`` counts pad units interleaved with the records).
        modulus: M; None means 2S of the spec you build for.
        prefix_ids: ids before the text (chat template ...); None means the tokenizer's own BOS/prefix.
        pad_id: id for right padding; None means the tokenizer's pad/EOS token.
    """

    kind: ClassVar[str] = "needle"

    tokenizer: Any = field(compare=False, repr=False, metadata={"serialize": False})
    keys: tuple[str, ...] = DEFAULT_KEYS
    values: tuple[str, ...] = DEFAULT_VALUES
    record_template: str = " {key}: {value}."
    intro: str = "Records:"
    query_prefix: str = "\nLookup:"
    pad_unit: str = " ."
    n_records: int = 32
    n_demos: int = 2
    block_filler: int = 0
    min_distance: int = 0
    target_records: tuple[int, int] | None = None
    modulus: int | None = None
    n_cycles: int = 1
    padding: str = "prefix"
    paired: bool = False
    prefix_ids: tuple[int, ...] | None = None
    pad_id: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            raise TaskError(
                "Needle needs a tokenizer: Needle(tokenizer, ...) or task_from_dict(d, tokenizer=tok)."
            )
        for name in ("keys", "values"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "prefix_ids", check_ids("prefix_ids", self.prefix_ids))
        object.__setattr__(self, "target_records", check_target_records(self.target_records))
        set_ints(self, {"n_records": 2, "n_cycles": 1, "n_demos": 0, "block_filler": 0, "min_distance": 0})
        if self.modulus is not None:
            set_ints(self, {"modulus": 1})
        if self.pad_id is not None:
            set_ints(self, {"pad_id": 0})
        set_flag(self, "paired")
        check_records(self.padding, self.n_records, len(self.keys), len(self.values), self.n_demos)
        split_template(self.record_template)

    # ---- tokenised pieces --------------------------------------------------------------------------
    @cached_property
    def _c(self) -> CompiledRecords:
        tok = self.tokenizer
        lit0, key_ws, lit1, value_ws, lit2 = split_template(self.record_template)
        keys = word_pool(tok, self.keys, key_ws, "key")
        values = word_pool(tok, self.values, value_ws, "value")
        if len({k.ids for k in keys}) != len(keys):
            raise TaskError("two keys tokenise identically; keys must be distinct.")
        if len({v.ids[0] for v in values}) != len(values):
            raise TaskError("values must have distinct first tokens (the answer is the value's first token).")
        unit = Piece(self.pad_unit, (unit_id(tok, self.pad_unit),), unit=True)
        prefix = self.prefix_ids if self.prefix_ids is not None else special_prefix(tok)
        return CompiledRecords(
            prefix,
            piece(tok, self.intro),
            (piece(tok, lit0), piece(tok, lit1), piece(tok, lit2)),
            keys,
            values,
            piece(tok, self.query_prefix),
            unit,
        )

    def _modulus(self, spec: PhaseSpec | None) -> int:
        if spec is None:
            if self.modulus is None:
                raise TaskError("this Needle's modulus is 2S of the spec; pass spec (or set modulus).")
            return self.modulus
        return check_modulus(spec, self.modulus)

    def plan(self, spec: PhaseSpec | None = None) -> layout.RegionPlan:
        c = self._c
        return layout.make_plan(
            start=len(c.prefix) + len(c.intro.ids),
            n_records=self.n_records,
            record_len=c.record_len,
            key_offset=c.key_offset,
            block_filler=self.block_filler,
            target_records=self.target_records,
            modulus=self._modulus(spec),
            n_cycles=self.n_cycles,
            origin=spec.origin if spec is not None else 0,
        )

    def _tail(self, plan: layout.RegionPlan) -> int:
        c = self._c
        query = plan.end + self.n_demos * c.demo_len + c.query_len - 1
        latest_value = plan.design.highest - c.key_offset + c.value_offset
        return max(0, self.min_distance - (query - latest_value))

    def seq_len(self, spec: PhaseSpec | None = None) -> int:
        """T, the length of every item (BOS and prefix included)."""
        plan = self.plan(spec)
        return plan.end + self._tail(plan) + self.n_demos * self._c.demo_len + self._c.query_len

    # ---- build -------------------------------------------------------------------------------------
    def build(
        self, spec: PhaseSpec, *, n_per_residue: int, residues: Sequence[int] | None = None, seed: int = 0
    ) -> TaskBatch:
        """Items at each requested residue; ``N = n_per_residue * len(residues)`` rows of equal length."""
        c, d = self._c, self.n_demos
        rows_ = self._rows(spec, n_per_residue, residues)
        plan, base, row_res, n_base = rows_.plan, rows_.base, rows_.residues, rows_.n_base
        tail = self._tail(plan)
        rng = np.random.default_rng(check_seed(seed))
        n = base.size

        drawn = draw_records(rng, n_base, plan, len(c.keys), len(c.values), d)
        keys, vals, demos = drawn.keys, drawn.values, drawn.demos
        pl = place_records(rng, plan, self.padding, n_base, base, row_res, drawn.target)
        t_key, tgt, is_record, starts, fill_slots = pl.t_key, pl.target, pl.is_record, pl.starts, pl.fill_slots

        key_ids = np.array([p.ids for p in c.keys], dtype=np.int64)
        val_ids = np.array([p.ids for p in c.values], dtype=np.int64)
        lit = [np.array(p.ids, dtype=np.int64) for p in c.lits]

        def records(k: np.ndarray, vv: np.ndarray | None) -> np.ndarray:
            """``[..., record_len]`` ids of records with key indices k (and value indices vv)."""
            shape = k.shape
            parts = [
                np.broadcast_to(lit[0], (*shape, lit[0].size)),
                key_ids[k],
                np.broadcast_to(lit[1], (*shape, lit[1].size)),
            ]
            if vv is not None:
                parts += [val_ids[vv], np.broadcast_to(lit[2], (*shape, lit[2].size))]
            return np.concatenate(parts, axis=-1)

        t_len = plan.end + tail + d * c.demo_len + c.query_len
        rows = np.arange(n)
        tokens = np.empty((n, t_len), dtype=np.int64)
        tokens[:, : len(c.prefix)] = c.prefix
        tokens[:, len(c.prefix) : plan.start] = c.intro.ids
        tokens[rows[:, None], fill_slots] = c.unit.ids[0]
        tokens[:, plan.end : plan.end + tail] = c.unit.ids[0]
        rec = records(keys, vals)[base]  # [N, R, L]
        tokens[rows[:, None, None], starts[:, :, None] + np.arange(c.record_len)] = rec
        qp = np.array(c.query_prefix.ids, dtype=np.int64)
        demo_rec = records(np.take_along_axis(keys, demos, 1), np.take_along_axis(vals, demos, 1))[base]
        at = plan.end + tail
        for j in range(d):
            tokens[:, at : at + qp.size] = qp
            tokens[:, at + qp.size : at + c.demo_len] = demo_rec[:, j]
            at += c.demo_len
        tokens[:, at : at + qp.size] = qp
        tokens[:, at + qp.size :] = records(keys[base, tgt], None)

        t_value = t_key - c.key_offset + c.value_offset
        answer = val_ids[vals[base, tgt], 0]
        wrong_val = vals[base, drawn.neighbour[base]]
        corrupted = tokens.copy()
        corrupted[rows[:, None], t_value[:, None] + np.arange(c.n_value)] = val_ids[wrong_val]
        self._verify(
            tokens[0], is_record[0], keys[base[0]], vals[base[0]], demos[base[0]], tgt[0], plan, tail
        )

        frame = self._frame(spec, rows_, t_key, t_value, tgt, t_len)
        frame["key"] = [self.keys[i] for i in keys[base, tgt]]
        frame["value"] = [self.values[i] for i in vals[base, tgt]]
        frame["answer"] = answer
        frame["wrong"] = val_ids[wrong_val, 0]
        pad = self.pad_id if self.pad_id is not None else default_pad_id(self.tokenizer, c.unit.ids[0])
        return TaskBatch(
            tokens=as_long(tokens),
            lengths=torch.full((n,), t_len, dtype=torch.long),
            query_pos=torch.full((n,), t_len - 1, dtype=torch.long),
            answer=as_long(answer),
            wrong=as_long(val_ids[wrong_val, 0]),
            corrupted=as_long(corrupted),
            frame=frame,
            spec=spec,
            modulus=rows_.modulus,
            pad_id=int(pad),
            task=f"needle/{self.padding}{'/paired' if self.paired else ''}",
        )

    def _verify(
        self,
        ids: np.ndarray,
        is_record: np.ndarray,
        keys: np.ndarray,
        vals: np.ndarray,
        demos: np.ndarray,
        target: int,
        plan: layout.RegionPlan,
        tail: int,
    ) -> None:
        """Check one assembled item against the tokenizer, and the pad unit at every kind of site."""
        c = self._c
        pieces: list[Piece] = [c.intro] if c.intro.text else []
        sites = [len(pieces)]  # region start: (intro | unit) and (unit | record)
        rec = iter(range(self.n_records))
        for is_rec in is_record.tolist():
            if is_rec:
                i = next(rec)
                pieces += c.record_pieces(int(keys[i]), int(vals[i]))
                if i == 0:
                    sites.append(len(pieces))  # after a record: (record | unit)
            else:
                pieces.append(c.unit)
        pieces += [c.unit] * tail
        sites.append(len(pieces))  # region end: (unit | demo or query)
        for j in demos.tolist():
            pieces += [c.query_prefix, *c.record_pieces(int(keys[j]), int(vals[j]))]
        pieces += [c.query_prefix, *c.record_pieces(int(keys[target]), None)]
        pieces = [p for p in pieces if p.text]
        built = verify_pieces(self.tokenizer, pieces, what="Needle item")
        if built != ids[len(c.prefix) :].tolist():
            raise TaskError("internal: assembled ids differ from the verified pieces; please report this.")
        # The answer must be what follows the query text: check the query continued by its value.
        verify_pieces(
            self.tokenizer,
            [c.query_prefix, *c.record_pieces(int(keys[target]), int(vals[target]))],
            what="Needle query + answer",
        )
        for s in sorted(set(sites)):
            check_pad_site(self.tokenizer, pieces, s, c.unit, what="Needle padding")
