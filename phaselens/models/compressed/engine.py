"""The compressed transformer's query-suffix engine: many per-head interventions at the query position for
little more than one forward (cells, passes and the clean step are shared: :mod:`phaselens.models.parts.suffix_engine`).

An intervention on ``z`` at the query position changes nothing at earlier positions. So the engine runs
the clean prefix once into a :class:`~phaselens.models.CompressedKVCache`, and for each *cell* (a set of
heads with replacement values at one layer) re-runs only the query position through the layers at and
above the intervened one, reading the frozen prefix cache. Many cells share one batched pass.

One subtlety: at the boundary phase the entry that completes at the query pools the query's own token.
The engine recomputes it in every layer above the intervened one, because the query step goes through the
same streaming compressor as decoding does (it reads the open block's projections from the cache).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phaselens.models.compressed.cache import CompressedKVCache, LayerCache
from phaselens.models.compressed.compressor import PoolerState
from phaselens.models.parts.hooking import query_start
from phaselens.models.parts.suffix_engine import HookList, SlotEngine


class FrozenPast:
    """A read-only view of one layer's prefix cache, repeated ``copies`` times along the batch.

    Implements the attention ``Past`` protocol without writing: new rows are concatenated, never stored.
    """

    def __init__(self, layer: LayerCache, start: int, copies: int) -> None:
        self.start = start
        self._copies = copies
        R = layer.ring
        device = layer.raw_k.device
        if layer.kind == "full":
            idx = torch.arange(start, device=device)
        else:
            idx = torch.arange(max(0, start - R), start, device=device) % max(R, 1)
        self._raw_k = self._rep(layer.raw_k.index_select(1, idx))
        self._raw_v = None if layer.raw_v is None else self._rep(layer.raw_v.index_select(1, idx))
        # head-major [copies * B, Hkv, E, d], as the cache stores them
        self._entries = {p: self._rep(s[:, :, : layer.n_entries[p]]) for p, s in layer.entry_store.items()}
        self._states = {
            p: PoolerState(*(self._rep(t) if t is not None else None for t in vars(st).values()))
            for p, st in layer.states.items()
        }

    def _rep(self, t: Tensor) -> Tensor:
        return t.repeat(self._copies, *([1] * (t.dim() - 1)))

    def raw_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys = torch.cat([self._raw_k, k], 1)
        values = keys if self._raw_v is None else torch.cat([self._raw_v, v], 1)
        return keys, values

    def entries(self, path: str, new: Tensor) -> Tensor:
        return torch.cat([self._entries[path], new.transpose(1, 2)], 2).transpose(1, 2)

    def pooler_state(self, path: str) -> PoolerState | None:
        return self._states[path] if self.start > 0 else None

    def set_pooler_state(self, path: str, state: PoolerState) -> None:
        pass


class SuffixEngine(SlotEngine):
    """Clean prefix once; per-cell query passes from the intervened layer up (a
    :class:`~phaselens.models.parts.suffix_engine.SlotEngine`: cells, passes and the clean step are shared).

    What this kind keeps: the prefix goes into a :class:`~phaselens.models.CompressedKVCache`, and a pass reads
    it through :class:`FrozenPast` views repeated once per pass width.

    Args (as every :class:`~phaselens.models.parts.suffix_engine.SlotEngine`'s):
        model: a :class:`~phaselens.models.CompressedTransformer`.
    """

    def prefill(self, tokens: Tensor) -> None:
        model = self.model
        self.query_tokens = tokens[:, self.q : self.q + 1]
        with torch.no_grad():
            self.cache = CompressedKVCache(model, self.n, self.q + 1)
            if self.q > 0:
                model(tokens[:, : self.q], cache=self.cache)
            self.clean_step(model.hook_embed(model.embed(self.query_tokens)), len(model.blocks))

    def run_layers(self, start: int, resid: Tensor, copies: int, hooks: HookList,
                   record: list[Any] | None = None) -> Tensor:
        """Residuals ``[copies * n, 1, D]`` into block ``start`` through the rest of the model: ``[copies * n, V]``."""
        model = self.model
        with model.hooks(fwd_hooks=hooks), query_start(self.q):
            for i in range(start, len(model.blocks)):
                if record is not None:
                    record.append(resid)
                past = self.repeated(i, copies, lambda i=i: FrozenPast(self.cache.layers[i], self.q, copies))
                resid = model.blocks[i](resid, past)
        return model.unembed(model.ln_final(resid))[:, 0]
