"""The V4.1 decoding cache, and the per-forward hand-off between layers.

:class:`V41Cache` holds what later calls need: per layer the last ``sliding_window - 1`` window keys, and per
KV *source* layer its compressed entries, the index keys derived from them and the projections of the
current, incomplete group, and the last ``max_ngram - 1`` compressed token ids (Engram's n-gram history). Consumer layers store nothing of their own: they read their source's entries, which
is what sharing means. A call stages its updates and :meth:`V41Cache.commit` applies them only once the whole
forward succeeded, so an error (or an interrupted hook) leaves the cache as it was.

:class:`StackRuntime` is what one forward hands down the layer stack (DeepSeek's reference keeps it in a
module-level singleton): the sources' entries, the index sources' picks and the candidate mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from phaselens.errors import CacheError


@dataclass
class SourceState:
    """A KV source's compressed state: ``entries`` ``[B, E, d]`` (what attention reads, after norm, RoPE and
    any round trip), ``index_keys`` ``[B, E, d_index]``, and ``pending_kv`` / ``pending_score`` ``[B, p, d]``
    (fp32 projections of the ``p = length mod ratio`` tokens of the open group; empty at ratio 1)."""

    entries: Tensor
    index_keys: Tensor
    pending_kv: Tensor
    pending_score: Tensor


class V41Cache:
    """A decoding cache for ``batch`` sequences of one :class:`~phaselens.models.deepseek_v41.DeepSeekV41`.

    ``model(tokens, cache=cache)`` continues the cached sequence at slot ``cache.length``; the logits equal
    those of one parallel forward over the whole sequence (tested to float rounding).
    """

    def __init__(self, model: Any, batch: int) -> None:
        self.batch = int(batch)
        self.length = 0
        self.window: dict[int, Tensor] = {}
        self.sources: dict[int, SourceState] = {}
        self._staged_window: dict[int, Tensor] = {}
        self._staged_sources: dict[int, SourceState] = {}
        self.ngram_history: Tensor | None = None  # [B, h] compressed ids of the last h <= max_ngram - 1 slots
        self._staged_ngram: Tensor | None = None
        self._model_id = id(model)

    def check(self, model: Any, batch: int) -> None:
        if id(model) != self._model_id:
            raise CacheError("this V41Cache belongs to another model; make one with model.new_cache(batch).")
        if batch != self.batch:
            raise CacheError(f"the cache holds {self.batch} sequences but the call has {batch}; use one cache per batch.")

    # ---- staging -----------------------------------------------------------------------------------
    def stage_window(self, layer: int, keys: Tensor) -> None:
        self._staged_window[layer] = keys

    def stage_source(self, layer: int, state: SourceState) -> None:
        self._staged_sources[layer] = state

    def stage_ngram_history(self, history: Tensor) -> None:
        self._staged_ngram = history

    def commit(self, n: int) -> None:
        """Apply the staged updates of a call of ``n`` tokens."""
        self.window.update(self._staged_window)
        self.sources.update(self._staged_sources)
        if self._staged_ngram is not None:
            self.ngram_history = self._staged_ngram
        self.discard()
        self.length += int(n)

    def discard(self) -> None:
        self._staged_window.clear()
        self._staged_sources.clear()
        self._staged_ngram = None

    @property
    def n_entries(self) -> dict[int, int]:
        """Entries stored per KV source layer."""
        return {layer: int(s.entries.shape[1]) for layer, s in self.sources.items()}

    def __repr__(self) -> str:
        return f"V41Cache(batch={self.batch}, length={self.length}, entries={self.n_entries})"


@dataclass
class StackRuntime:
    """Shared state of one forward: ``entries`` / ``index_keys`` per KV source (``[B, E, .]``, earlier calls'
    rows included), ``picks`` per index source (``[B, n, E]`` bool), the candidate mask ``[B, n, E]``, and the
    layers where the indexer's top-k or the candidate filter dropped a visible entry."""

    entries: dict[int, Tensor] = field(default_factory=dict)
    index_keys: dict[int, Tensor] = field(default_factory=dict)
    picks: dict[int, Tensor] = field(default_factory=dict)
    candidates: Tensor | None = None
    topk_binding: set[int] = field(default_factory=set)
    candidate_binding: set[int] = field(default_factory=set)
