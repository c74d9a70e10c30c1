"""Splitting a forward over ``T`` tokens into prefill pieces and the query piece.

A chunked forward runs the prefix, ``tokens[:, :T - q]``, in pieces of ``chunk`` tokens through the model's
cache (unhooked, without gradients), then the **query piece**, the last ``q = query_len`` tokens (default
``min(chunk, T)``), as one more call: only that call is hooked. Attention then holds ``[B, H, chunk, ...]``
scores instead of ``[B, H, T, ...]``. Every kind plans its pieces here, so a forward, its memory estimate and a
query engine agree on them.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from phaselens.errors import InputError


@dataclass(frozen=True)
class ChunkPlan:
    """Token ranges ``[start, stop)``: the ``prefix`` pieces, in order, then the hooked ``query`` range."""

    prefix: tuple[tuple[int, int], ...]
    query: tuple[int, int]

    @property
    def query_start(self) -> int:
        return self.query[0]

    @property
    def query_rows(self) -> int:
        """Tokens in the query piece."""
        return self.query[1] - self.query[0]

    @property
    def calls(self) -> tuple[tuple[int, int], ...]:
        """Every call's range: the prefix pieces, then the query piece."""
        return (*self.prefix, self.query)


def _positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def plan_chunks(T: int, chunk: int | None, query_len: int | None) -> ChunkPlan:
    """Split ``T`` tokens: the query piece is the last ``query_len`` (default ``min(chunk, T)``) tokens and the
    rest is prefilled in pieces of ``chunk``.

    ``chunk=None`` and no ``query_len``: one unchunked call. ``chunk=None`` with a ``query_len``: the prefix in
    one piece, then the query piece (a query engine's split). A forward whose unchunked call keeps ``query_len``
    for its logits rows only passes ``query_len if chunk is not None else None``.

    Raises:
        InputError: ``chunk`` is not a positive int, or ``query_len`` not an int in ``1..T``.
    """
    if chunk is None and query_len is None:
        return ChunkPlan((), (0, T))
    if chunk is not None and not _positive_int(chunk):
        raise InputError(f"chunk must be a positive int (tokens per prefill piece) or None, got {chunk!r}.")
    chunk = None if chunk is None else int(chunk)
    q = query_len if query_len is not None else min(chunk, T)
    if not _positive_int(q) or q > T:
        raise InputError(f"query_len must be an int in 1..{T} (the hooked last tokens), got {query_len!r}.")
    q = int(q)
    start = T - q
    step = chunk or start or 1
    return ChunkPlan(tuple((s, min(s + step, start)) for s in range(0, start, step)), (start, T))
