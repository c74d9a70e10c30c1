"""Fixed-length text records for ``Needle``: the template, the word pools and their token ids.

A record is a template such as ``" {key}: {value}."``. Whitespace right before a slot belongs to the slot's
token (``" cat"``), as BPE vocabularies store it, so the pieces are ``lit0 | key | lit1 | value | lit2``. Each
piece is tokenised once; ``Needle`` concatenates their ids and verifies the result on assembled text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phaselens.errors import TaskError
from phaselens.tasks.text import Piece, piece

DEFAULT_KEYS = (
    "cat", "dog", "cow", "pig", "fox", "owl", "bee", "ant", "bat", "rat", "hen", "elk", "yak", "ape", "eel",
    "emu", "bear", "deer", "duck", "frog", "goat", "hawk", "lion", "mole", "moth", "mule", "seal", "swan",
    "toad", "wolf", "crab", "crow", "dove", "fish", "lamb", "mink", "newt", "puma", "slug", "wasp", "worm",
    "zebra", "horse", "mouse", "sheep", "tiger", "whale", "snake",
)  # fmt: skip
DEFAULT_VALUES = (
    "Anna", "Ben", "Carl", "Dan", "Eve", "Fred", "Gina", "Hugo", "Ida", "Jack", "Kate", "Leo", "Mia", "Ned",
    "Olga", "Paul", "Rosa", "Sam", "Tina", "Ugo", "Vera", "Walt", "Xena", "Yuri", "Zoe", "Adam", "Bill",
    "Cleo", "Dora", "Emil", "Finn", "Gus", "Hans", "Ivan", "Jane", "Karl", "Lily", "Max", "Nina", "Otto",
    "Pia", "Ray", "Sara", "Tom", "Uma", "Vic", "Will", "Yves",
)  # fmt: skip


def split_template(template: str) -> tuple[str, str, str, str, str]:
    """``(lit0, key_ws, lit1, value_ws, lit2)``: literals, and the whitespace that moves into each slot.

    Whitespace right before a slot belongs to the slot's token (``" cat"``), as BPE vocabularies store it.
    """
    if template.count("{key}") != 1 or template.count("{value}") != 1:
        raise TaskError(f"record_template needs exactly one {{key}} and one {{value}}, got {template!r}.")
    ik, iv = template.index("{key}"), template.index("{value}")
    if iv < ik:
        raise TaskError(f"record_template must put {{key}} before {{value}}, got {template!r}.")
    pre, mid, post = template[:ik], template[ik + 5 : iv], template[iv + 7 :]
    lit0, lit1 = pre.rstrip(), mid.rstrip()
    return lit0, pre[len(lit0) :], lit1, mid[len(lit1) :], post


@dataclass(frozen=True)
class CompiledRecords:
    """Token ids of every piece of a Needle (prefix, intro, record literals, pools, query prefix, unit)."""

    prefix: tuple[int, ...]
    intro: Piece
    lits: tuple[Piece, Piece, Piece]
    keys: tuple[Piece, ...]
    values: tuple[Piece, ...]
    query_prefix: Piece
    unit: Piece

    @property
    def n_key(self) -> int:
        return len(self.keys[0].ids)

    @property
    def n_value(self) -> int:
        return len(self.values[0].ids)

    @property
    def key_offset(self) -> int:
        return len(self.lits[0].ids) + self.n_key - 1

    @property
    def value_offset(self) -> int:
        return len(self.lits[0].ids) + self.n_key + len(self.lits[1].ids)

    @property
    def record_len(self) -> int:
        return self.value_offset + self.n_value + len(self.lits[2].ids)

    @property
    def query_len(self) -> int:
        return len(self.query_prefix.ids) + self.value_offset

    @property
    def demo_len(self) -> int:
        return len(self.query_prefix.ids) + self.record_len

    def record_pieces(self, k: int, v: int | None) -> list[Piece]:
        """Pieces of record (key k, value v); ``v=None`` stops before the value (the query)."""
        out = [self.lits[0], self.keys[k], self.lits[1]]
        if v is not None:
            out += [self.values[v], self.lits[2]]
        return [p for p in out if p.text]


def word_pool(tok: Any, words: Sequence[str], ws: str, what: str) -> tuple[Piece, ...]:
    pieces = tuple(piece(tok, ws + w) for w in words)
    counts = {len(p.ids) for p in pieces}
    if len(counts) != 1 or 0 in counts:
        modal = max(counts, key=lambda c: sum(len(p.ids) == c for p in pieces))
        odd = [p.text for p in pieces if len(p.ids) != modal][:8]
        raise TaskError(
            f"every {what} must be the same number of tokens so records have a fixed length; most are {modal}, "
            f"but {odd} are not. Remove them or pass your own {what}s."
        )
    return pieces
