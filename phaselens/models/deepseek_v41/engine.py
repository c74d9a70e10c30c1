"""The query-suffix engine of phaselens's DeepSeek-V4.1: many query-row interventions over one cached prefix.

The shared design is :class:`~phaselens.models.parts.suffix_engine.SlotEngine` (cells as rows, the clean query step, the
pass loop and its memory budget). What V4.1 keeps here:

* **the prefix**: ``tokens[:, :q]`` once into a :class:`~.cache.V41Cache` (in pieces of the model's ``chunk``,
  hooks silent): per layer the window's last ``sliding_window - 1`` keys, per KV source its entries, index
  keys and the open group's projections, and Engram's n-gram history;
* **the query row's input** per layer: the hyper-connection streams ``[n, 1, hc, D]`` and the ``pre`` collapse
  weights ``[n, 1, hc]`` the previous block handed on, and the Engram table rows of the query token
  ``[n, 1, n_engram, cols]`` (they depend on token ids only, so every cell reuses them);
* **the clean shared state of the query row** (:class:`~.cache.StackRuntime`): each KV source's entries and
  index keys *with the entry the query itself completes*, each index source's picks, the candidate mask.

A pass of ``C`` cells at layer ``l`` runs the model's own blocks ``l..L-1`` on ``C x n`` query rows, exactly
as one cached decoding step of the query token does, over the prefix repeated ``C`` times (never written: the
cache only stages, and the stage is dropped). The shared state handed in holds only what layers *below* ``l``
published; everything a layer at or above ``l`` publishes is recomputed from the intervened rows:

* at each KV source ``s >= l``: the query row's projections, and when the query completes an entry (ratio 1:
  always; ratio 2: at the boundary phase, pooled with the prefix's open-group projection) that entry, its
  RoPE / FP4 round trip and its index key, appended to the prefix's entries;
* at each index source ``i >= l``: the query row's indexer scores over those entries, the candidate blocks (at
  the candidate source) and the top-k picks;
* at every layer ``>= l``: the query's own window key and Engram's gated lookup.

Sources below ``l`` saw only clean inputs, so their published state (entries, picks, candidates) is exactly the
clean one; the prefix's entries never depend on the query row. So a pass equals a full forward with the cell
written at the query slot, to the float rounding by which cached decoding equals a parallel forward (tested at
1e-5 in fp32 in every ``quantize`` setting, with and without Engram, packed and dequantized weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phaselens.core import margins
from phaselens.models.deepseek_v41.cache import SourceState, StackRuntime, V41Cache
from phaselens.models.deepseek_v41.layers import hc_pre
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.hooking import query_start, silent_hooks
from phaselens.models.parts.suffix_engine import HookList, SlotEngine, repeat_rows


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class V41SuffixEngine(SlotEngine):
    """Clean prefix once; per-cell query passes from the intervened layer up (one query slot). It measures the
    rounding margins of the model's top-k picks, router and FP8/FP4 roundings (``last_fragile`` after ``run``).

    Args (as every :class:`~phaselens.models.parts.suffix_engine.SlotEngine`'s):
        model: a :class:`~phaselens.models.deepseek_v41.DeepSeekV41`.

    Attributes:
        clean_logits: ``[n, V]``; clean_z: per layer ``[n, H, d]``; resid_pre: per layer the query row's
        ``(streams [n, 1, hc, D], pre [n, 1, hc])`` entering the block (before its Engram).
    """

    measures_margins = True

    def prefill(self, tokens: Tensor) -> None:
        model = self.model
        self.clean_runtime: StackRuntime | None = None  # the clean query step's shared state (set by it)
        q, cfg = self.q, model.config
        with torch.no_grad(), margins.recording(self.n) as prefix:
            self.cache = V41Cache(model, self.n)
            step = model.chunk or max(q, 1)
            with silent_hooks():
                for a in range(0, q, step):
                    model._call(tokens[:, a : min(a + step, q)], self.cache, "all", None, head=False)
            ids = tokens[:, q : q + 1]
            self.engram_rows = model._engram_rows(ids, self.cache)  # [n, 1, n_engram, cols] or None
            self.cache.discard()  # the query's n-gram history is staged: the prefix stays as it was
            with query_start(q):
                h = model.hook_embed(model.embed(ids))
            x = h.unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
            pre = torch.zeros(self.n, 1, cfg.hc_mult, dtype=compute_dtype(h.dtype), device=h.device)
            pre[..., 0] = 1.0  # one-hot: the first block's attention reads stream 0
            self.clean_step((x, pre), len(model.blocks))
        self.prefix_fragile = prefix.flags
        self.layer_row_bytes = [self._bytes_per_row(layer) for layer in range(len(model.blocks))]

    # ---- the kind's part of SlotEngine ----------------------------------------------------------------
    def run_layers(self, start: int, state: tuple[Tensor, Tensor], copies: int, hooks: HookList,
                   record: list[Any] | None = None) -> Tensor:
        """The query rows' ``(streams [copies * n, 1, hc, D], pre [copies * n, 1, hc])`` into block ``start``
        through the rest of the model and the head: logits ``[copies * n, V]`` (fp32)."""
        model = self.model
        x, pre = state
        cache = self._pass_cache(start, copies)
        rt = self._runtime(start, copies)
        rows = None if self.engram_rows is None else repeat_rows(self.engram_rows, copies)
        with model.hooks(fwd_hooks=hooks), query_start(self.q):
            for block in model.blocks[start:]:
                if record is not None:
                    record.append((x, pre))
                x, pre = block(x, pre, self.q, cache, rt, rows)
        cache.discard()
        model._note_binding(rt, self.q + 1)
        if record is not None:  # the clean step: keep what every layer published for the passes
            self.clean_runtime = rt
        final = model.norm(hc_pre(x, pre))
        return model.head(final.to(model.head.weight.dtype))[:, 0]

    # ---- the prefix and the clean shared state, repeated for a pass ------------------------------------
    def _pass_cache(self, start: int, copies: int) -> V41Cache:
        """A cache of ``copies * n`` rows for layers ``start..L-1``: the prefix's window keys and KV-source states,
        repeated (shared by every pass of this width; a pass only stages, and the stage is discarded)."""
        cache = V41Cache(self.model, copies * self.n)
        cache.length = self.q
        for layer in range(start, len(self.model.blocks)):
            if layer in self.cache.window:
                cache.window[layer] = self.repeated(("window", layer), copies,
                                                    lambda w=self.cache.window[layer]: repeat_rows(w, copies))
            if layer in self.cache.sources:
                src = self.cache.sources[layer]
                cache.sources[layer] = self.repeated(("source", layer), copies, lambda s=src: SourceState(
                    *(repeat_rows(t, copies) for t in (s.entries, s.index_keys, s.pending_kv, s.pending_score))))
        return cache

    def _runtime(self, start: int, copies: int) -> StackRuntime:
        """The shared state layers ``start..`` read from layers below ``start``: the clean query step's entries
        and index keys of KV sources ``< start``, picks of index sources ``< start``, and the candidate mask if
        its source is ``< start`` (repeated ``copies`` times). Nothing published at or above ``start``: the pass
        recomputes it from the intervened rows."""
        rt = StackRuntime()
        clean = self.clean_runtime
        if clean is None:  # the clean step itself
            return rt
        for name in ("entries", "index_keys", "picks"):
            getattr(rt, name).update({k: self.repeated((name, k), copies, lambda v=v: repeat_rows(v, copies))
                                      for k, v in getattr(clean, name).items() if k < start})
        source = self.model.config.candidate_source_layer_id
        if clean.candidates is not None and 0 <= source < start:
            rt.candidates = self.repeated("candidates", copies, lambda: repeat_rows(clean.candidates, copies))
        return rt

    def _bytes_per_row(self, start: int) -> int:
        """Memory per row of a pass from ``start``: the repeated prefix (window keys, KV-source states) and clean
        shared state, the sources' entries concatenated anew, and the widest layer's attention temporaries
        (about four ``[H, window + entries]`` and two indexer ``[H_index, entries]`` fp32 tensors)."""
        L, cfg = len(self.model.blocks), self.model.config
        window = sum(_nbytes(self.cache.window.get(i)) for i in range(start, L))
        sources = sum(2 * _nbytes(s.entries, s.index_keys) + _nbytes(s.pending_kv, s.pending_score)
                      for i, s in self.cache.sources.items() if i >= start)
        clean = self.clean_runtime or StackRuntime()
        shared = sum(_nbytes(*(d[k] for d in (clean.entries, clean.index_keys) if k in d))
                     for k in clean.entries if k < start) + sum(_nbytes(v) for k, v in clean.picks.items() if k < start)
        widest = max([s.entries.shape[1] + 1 for s in self.cache.sources.values()] or [1])
        attention = 4 * (4 * cfg.num_attention_heads + 2 * cfg.index_n_heads) * (cfg.sliding_window + widest)
        return (window + sources + shared) // max(self.n, 1) + attention


__all__ = ["V41SuffixEngine"]
