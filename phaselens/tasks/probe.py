"""``PaddingProbe``: one prompt, a padding line whose length sweeps, and a two-way completion.

The paper's FP8 probe, generalised: a prompt holds a pad marker and a cursor marker. The pad marker is
replaced by ``n`` single-token units (e.g. ``" ="``); the text is cut at the cursor, where the model should
continue with ``correct`` rather than ``wrong``. Sweeping ``n`` moves the cursor through every phase while
the content stays the same, so P(correct) as a function of the total length ``L`` shows the phase effect.

Positions are slots of the full id sequence, ``prefix_ids`` (BOS, chat template) included, and the
residue/phase columns describe the **cursor** (the last prompt position ``L - 1``, whose logits are scored).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import TaskError
from phaselens.tasks.batch import TaskBatch, as_long
from phaselens.tasks.residues import (
    check_count,
    check_ids,
    check_modulus,
    check_residues,
    check_seed,
    set_ints,
)
from phaselens.tasks.serialization import SerializableTask, register_task
from phaselens.tasks.text import (
    Piece,
    UnitPadded,
    check_pad_site,
    default_pad_id,
    encode,
    piece,
    special_prefix,
    unit_id,
    verify_pieces,
)

EXAMPLES = "examples"


@dataclass(frozen=True)
class _Compiled:
    prefix: tuple[int, ...]
    before: Piece
    between: Piece
    unit: Piece
    answer: int
    wrong: int

    def length(self, n_units: int) -> int:
        return len(self.prefix) + len(self.before.ids) + n_units + len(self.between.ids)

    def pieces(self, n_units: int) -> list[Piece]:
        return [p for p in (self.before, *[self.unit] * n_units, self.between) if p.text]


@register_task
@dataclass(frozen=True)
class PaddingProbe(UnitPadded, SerializableTask):
    """A completion probe swept over padding lengths.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or transformers fast tokenizer (not serialised).
        prompt: text with one ``pad_marker`` and, after it, one ``cursor_marker``; text after the cursor is
            ignored (keep it for readability).
        correct, wrong: the two continuations; their first tokens are ``answer`` and ``wrong``.
        unit: the one-token padding unit that replaces the pad marker ``n`` times.
        min_units, max_units: the sweep of ``n`` (inclusive) from which ``build`` takes its lengths.
        modulus: M; None means 2S of the spec.
        prefix_ids: ids before the prompt; None means the tokenizer's own BOS/prefix.
        pad_id: id for right padding; None means the tokenizer's pad/EOS token.
        name: a label for reports.
    """

    kind: ClassVar[str] = "padding_probe"

    tokenizer: Any = field(compare=False, repr=False, metadata={"serialize": False})
    prompt: str = ""
    correct: str = ""
    wrong: str = ""
    unit: str = " ="
    min_units: int = 1
    max_units: int = 40
    modulus: int | None = None
    prefix_ids: tuple[int, ...] | None = None
    pad_id: int | None = None
    pad_marker: str = "<|pad|>"
    cursor_marker: str = "<|cursor|>"
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            raise TaskError("PaddingProbe needs a tokenizer (task_from_dict(d, tokenizer=tok)).")
        object.__setattr__(self, "prefix_ids", check_ids("prefix_ids", self.prefix_ids))
        if self.modulus is not None:
            set_ints(self, {"modulus": 1})
        if self.pad_id is not None:
            set_ints(self, {"pad_id": 0})
        for marker in (self.pad_marker, self.cursor_marker):
            if self.prompt.count(marker) != 1:
                raise TaskError(
                    f"prompt must contain {marker!r} exactly once (found {self.prompt.count(marker)})."
                )
        if self.prompt.index(self.pad_marker) > self.prompt.index(self.cursor_marker):
            raise TaskError("the pad marker must come before the cursor marker.")
        if not self.correct or not self.wrong or self.correct == self.wrong:
            raise TaskError("correct and wrong must be two different, non-empty continuations.")
        set_ints(self, {"min_units": 0})
        set_ints(self, {"max_units": self.min_units})

    # ---- constructors ------------------------------------------------------------------------------
    @classmethod
    def fp8_example(cls, tokenizer: Any, **overrides: Any) -> PaddingProbe:
        """Our FP8 (e4m3) block-quantisation helper; the cursor follows ``torch.float`` (``8``, not ``32``).

        The padding is a docstring line of ``" ="`` units. The sweep starts at one unit: with zero the line is
        whitespace only, which many tokenizers merge with the next line's indentation.
        """
        text = resources.files("phaselens.tasks").joinpath(EXAMPLES, "fp8_quant.py.txt").read_text()
        kwargs = {
            "prompt": text,
            "correct": "8",
            "wrong": "32",
            "unit": " =",
            "min_units": 1,
            "max_units": 40,
            "name": "fp8_e4m3",
        }
        kwargs.update(overrides)
        return cls(tokenizer, **kwargs)

    # ---- tokenised pieces --------------------------------------------------------------------------
    @cached_property
    def _c(self) -> _Compiled:
        tok = self.tokenizer
        head, rest = self.prompt.split(self.pad_marker)
        middle = rest.split(self.cursor_marker)[0]
        unit = Piece(self.unit, (unit_id(tok, self.unit),), unit=True)
        before, between = piece(tok, head), piece(tok, middle)
        prefix = self.prefix_ids if self.prefix_ids is not None else special_prefix(tok)
        ids = {}
        for label, text in (("correct", self.correct), ("wrong", self.wrong)):
            stem = "".join(p.text for p in (before, *[unit] * max(self.min_units, 1), between))
            prompt_ids = encode(tok, stem)  # the padding itself is checked in build
            full = encode(tok, stem + text)
            if full[: len(prompt_ids)] != prompt_ids or len(full) == len(prompt_ids):
                raise TaskError(
                    f"the {label} continuation {text!r} merges with the prompt's end at the cursor; "
                    "move the cursor so that the continuation starts a new token."
                )
            ids[label] = full[len(prompt_ids)]
        if ids["correct"] == ids["wrong"]:
            raise TaskError(f"correct {self.correct!r} and wrong {self.wrong!r} start with the same token.")
        return _Compiled(prefix, before, between, unit, ids["correct"], ids["wrong"])

    def length(self, n_units: int) -> int:
        """L, the number of ids with ``n_units`` units (prefix included)."""
        return self._c.length(n_units)

    def seq_len(self, spec: PhaseSpec | None = None) -> int:
        """The longest L of the sweep (``max_units`` units)."""
        return self._c.length(self.max_units)

    # ---- build -------------------------------------------------------------------------------------
    def build(
        self, spec: PhaseSpec, *, n_per_residue: int, residues: Sequence[int] | None = None, seed: int = 0
    ) -> TaskBatch:
        """One item per length L: the first ``n_per_residue`` lengths of the sweep at each residue.

        The residue is that of the cursor, ``(L - 1 - origin) mod M``. The kept lengths must include a run
        of at least 2S consecutive values (two full periods), else TaskError. ``item_id`` is the period index
        (the k-th length at each residue), so each period forms one paired item. ``seed`` is unused (the
        probe is deterministic). Sequences differ in length and are right-padded.
        """
        c = self._c
        modulus = check_modulus(spec, self.modulus)
        res = check_residues(residues, modulus)
        k = check_count(n_per_residue)
        check_seed(seed)  # unused, but a bad one is still refused
        n_units = np.arange(self.min_units, self.max_units + 1)
        lengths = c.length(0) + n_units
        if lengths[0] - 1 < spec.origin:
            raise TaskError(
                f"the shortest prompt ends at slot {lengths[0] - 1}, before the origin {spec.origin}."
            )
        cursor_res = (lengths - 1 - spec.origin) % modulus
        keep, period = [], []
        for r in res.tolist():
            at = np.flatnonzero(cursor_res == r)
            if at.size < k:
                raise TaskError(
                    f"the sweep {self.min_units}..{self.max_units} units gives {at.size} length(s) at residue {r}, "
                    f"fewer than n_per_residue={k}; raise max_units to {self.max_units + (k - at.size) * modulus}."
                )
            keep += at[:k].tolist()
            period += list(range(k))
        order = np.argsort(keep, kind="stable")
        keep, period = np.asarray(keep)[order], np.asarray(period)[order]
        kept_l = lengths[keep]
        runs = np.split(kept_l, np.flatnonzero(np.diff(kept_l) != 1) + 1)
        longest = max(len(run) for run in runs)
        if longest < 2 * spec.stride:
            raise TaskError(
                f"the probe's lengths cover at most {longest} consecutive values; two full periods need "
                f"{2 * spec.stride} (S={spec.stride}). Request all residues and n_per_residue >= "
                f"{-(-2 * spec.stride // modulus)}."
            )
        for n in n_units[keep].tolist():
            verify_pieces(self.tokenizer, c.pieces(n), what=f"PaddingProbe with {n} units")
        first = int(n_units[keep].min())
        pieces = c.pieces(first)
        lead = 1 if c.before.text else 0
        for site in (lead, lead + first):  # before the first unit and after the last one
            check_pad_site(self.tokenizer, pieces, site, c.unit, what="PaddingProbe padding")

        t = int(kept_l.max())
        pad = self.pad_id if self.pad_id is not None else default_pad_id(self.tokenizer, c.unit.ids[0])
        tokens = np.full((keep.size, t), pad, dtype=np.int64)
        for row, n in enumerate(n_units[keep].tolist()):
            ids = [*c.prefix, *c.before.ids, *c.unit.ids * n, *c.between.ids]
            tokens[row, : len(ids)] = ids
        query = kept_l - 1
        frame = pd.DataFrame(
            {
                "item_id": period,
                "L": kept_l,
                "n_units": n_units[keep],
                "residue": spec.residue(query, modulus),
                "phase": spec.phase(query),
                "t_K": pd.array([pd.NA] * keep.size, dtype="Int64"),
                "t_V": pd.array([pd.NA] * keep.size, dtype="Int64"),
                "key_entries": [()] * keep.size,
                "value_entries": [()] * keep.size,
                "boundary": pd.array([pd.NA] * keep.size, dtype="boolean"),
                "shared_entry": pd.array([pd.NA] * keep.size, dtype="boolean"),
                "query_pos": query,
                "query_phase": spec.phase(query),
                "query_boundary": spec.is_boundary(query),
            }
        )
        out = as_long(tokens)
        return TaskBatch(
            tokens=out,
            lengths=as_long(kept_l),
            query_pos=as_long(query),
            answer=torch.full((keep.size,), c.answer, dtype=torch.long),
            wrong=torch.full((keep.size,), c.wrong, dtype=torch.long),
            corrupted=out.clone(),
            frame=frame,
            spec=spec,
            modulus=modulus,
            pad_id=int(pad),
            task=f"padding_probe/{self.name}",
        )
