"""A model's layers as data, and the bytes of a forward computed from them: the one per-layer table.

Each model kind describes its layers in a :class:`LayerTable` (``models/<kind>/layer_table.py``): per layer its
attention (heads, head size, the entries it attends and how many tokens each covers), what its cache holds
(:class:`Store`), and what a call computes and moves (:class:`Work`, where the kind prices time); per model the
weights, the window, the logits and the transients of a call. The bytes of a forward (its
``estimate_memory`` capability, every run's price, ``phaselens.plan``) and its FLOPs and traffic
(:mod:`phaselens.planning.flops`) are computed from this one table: a kind states facts about its layers, and
no kind sums bytes or FLOPs of its own.

Sizes (``width`` x ``item``) are elements and bytes of one row; every count is an exact int. A call covers
slots ``start .. stop - 1`` (``n = stop - start`` new tokens) of ``batch`` sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from phaselens.contract.memory import MemoryEstimate

Rows = Literal["window", "entries", "open", "block"]


@dataclass(frozen=True)
class Store:
    """A tensor a layer's cache holds after ``T`` tokens: ``rows x width`` elements of ``item`` bytes, ``copies``
    times. ``rows``: ``"window"`` (the last ``min(T, window - 1)`` tokens), ``"entries"`` (``T // ratio``
    finished entries), ``"open"`` (``T % ratio`` tokens of the open block), ``"block"`` (``ratio`` rows, kept
    once ``T >= ratio``: an overlapping compressor's previous block)."""

    rows: Rows
    width: int
    item: int
    copies: int = 1
    ratio: int = 0

    def count(self, T: int, window: int) -> int:
        r = self.ratio
        n = {"window": min(T, window - 1), "entries": T // r if r else 0, "open": T % r if r else 0,
             "block": r if r and T >= r else 0}[self.rows]
        return n * self.width * self.item * self.copies


@dataclass(frozen=True)
class Work:
    """What one layer computes and moves per call, as coefficients (multiply-adds; FLOPs are twice them).

    Attributes:
        macs, macs_fp32: per token, in the model's dtype and in fp32 (projections, activated experts, the
            compressor, the indexer's queries; mixes, router, the window's scores).
        macs_fp32_per_score: fp32 per (query, entry scored) pair (the attention over entries).
        macs_per_new_entry: per entry the call finishes (the indexer's keys).
        macs_per_pair: per (query, entry) pair, model dtype (the indexer's scores; 0 without an indexer).
        weight_held, weight_dense: weights read per call besides the routed experts, as held and the
            dequantized size of its packed ones (written and read once more); ``expert_held``,
            ``expert_dense`` the same per routed expert used, of ``n_experts`` with ``experts_per_token``
            chosen by each token.
        bytes_per_token, bytes_per_entry: traffic per token (score tensors of the window, unfolds, streams)
            and per entry attended (entries copied to fp32, index keys).
        bytes_per_score, bytes_per_pair: per (query, entry scored) pair (the attention's score tensors) and per
            (query, entry) pair (the indexer's scores).
        engram_macs, engram_weight_bytes: Engram's projection (multiply-adds per token) and its weights read per
            call; ``engram_rows`` rows it looks up per token, each ``engram_row_bytes`` of GPU traffic and
            ``engram_host_row_bytes`` sent from the host (0 without Engram).
    """

    macs: int = 0
    macs_fp32: int = 0
    macs_fp32_per_score: int = 0
    macs_per_new_entry: int = 0
    macs_per_pair: int = 0
    weight_held: int = 0
    weight_dense: int = 0
    expert_held: int = 0
    expert_dense: int = 0
    n_experts: int = 0
    experts_per_token: int = 0
    bytes_per_token: int = 0
    bytes_per_entry: int = 0
    bytes_per_score: int = 0
    bytes_per_pair: int = 0
    engram_macs: int = 0
    engram_weight_bytes: int = 0
    engram_rows: int = 0
    engram_row_bytes: int = 0
    engram_host_row_bytes: int = 0


@dataclass(frozen=True)
class LayerRow:
    """One layer: its ``kind`` (``"sliding"``, ``"ratio 4"``, ...), ``n_heads`` query heads of ``d_head``,
    ``ratio`` tokens per entry it attends (0: none; ``entry_ratio``: its entries' source's), whether it makes
    entries (``makes_entries``: a KV source) and picks them (``picks``: an index source), what its cache holds
    (``cache``) and its work per call (``work``, ``None`` where the kind prices no time)."""

    layer: int
    kind: str
    n_heads: int
    d_head: int
    ratio: int = 0
    entry_ratio: int = 0
    makes_entries: bool = False
    picks: bool = False
    cache: tuple[Store, ...] = ()
    work: Work | None = None


@dataclass(frozen=True)
class LayerTable:
    """A model's layers (``rows``) and what a call holds besides them.

    Attributes:
        weights: bytes of every parameter and buffer as held.
        window: the sliding window (keys of local attention).
        vocab, logits_item: the vocabulary and the bytes of one logit.
        score_item: bytes of one attention score; ``keys``: ``"cached"`` (a call attends the cached window,
            then its own tokens: ``min(start, window - 1) + n`` keys) or ``"unfold"`` (every query its own
            window of ``window`` keys); ``sink``: extra key columns; every entry of a layer's source is
            scored too.
        per_token, per_pair: bytes of a call's other transients per token (fp32 streams, the window's unfold,
            Engram's rows) and per (token, entry) (the indexer's scores); ``fixed``: transients alive in any
            call (packed weights being dequantized).
        index_topk: entries a sparse kernel attends per query (``None``: every entry).
        head_macs_fp32, head_weight_bytes, head_bytes_per_row: the final norm and the head per row of logits.
    """

    rows: tuple[LayerRow, ...]
    weights: int
    window: int
    vocab: int
    logits_item: int
    score_item: int
    keys: Literal["cached", "unfold"] = "cached"
    sink: int = 0
    per_token: int = 0
    per_pair: int = 0
    fixed: int = 0
    index_topk: int | None = None
    head_macs_fp32: int = 0
    head_weight_bytes: int = 0
    head_bytes_per_row: int = 0

    @property
    def n_heads(self) -> int:
        return max(r.n_heads for r in self.rows)

    def entries(self, stop: int) -> int:
        """Most entries any layer attends at slot ``stop`` (every entry of its source so far)."""
        return max((stop // r.ratio for r in self.rows if r.ratio), default=0)

    def cache_bytes(self, tokens: int, batch: int = 1) -> int:
        """The cache after ``tokens`` tokens of ``batch`` sequences: every layer's stores."""
        return batch * sum(s.count(int(tokens), self.window) for r in self.rows for s in r.cache)

    def score_bytes(self, start: int, stop: int, batch: int = 1) -> int:
        """The largest attention score tensor ``[B, H, n, keys]`` of the call on slots ``start .. stop - 1``."""
        n = stop - start
        keys = min(start, self.window - 1) + n if self.keys == "cached" else self.window
        return batch * self.n_heads * n * (keys + self.entries(stop) + self.sink) * self.score_item

    def transient_bytes(self, start: int, stop: int, batch: int = 1) -> int:
        """The call's other transients (``per_token`` and ``per_pair``; ``fixed`` comes on top)."""
        n = stop - start
        return batch * n * self.per_token + batch * n * self.entries(stop) * self.per_pair

    def memory(self, tokens: int, calls: Sequence[tuple[int, int]], *, batch: int = 1, chunk: int | None = None,
               query_rows: int, logit_rows: int, cached: bool = True) -> MemoryEstimate:
        """The :class:`MemoryEstimate` of a forward of ``tokens`` tokens run as ``calls`` (the kind's chunk
        plan), ``logit_rows`` rows of logits, the cache kept (``cached``) or not (one uncached call)."""
        T, B = int(tokens), int(batch)
        attention = max(self.score_bytes(a, b, B) for a, b in calls)
        transients = max(self.transient_bytes(a, b, B) for a, b in calls)
        activations = transients + self.fixed if (self.per_token or self.per_pair or self.fixed) else 0
        return MemoryEstimate(T, B, chunk, query_rows, self.weights, self.cache_bytes(T, B) if cached else 0,
                              attention, B * logit_rows * self.vocab * self.logits_item, activations)


__all__ = ["LayerRow", "LayerTable", "Store", "Work"]
