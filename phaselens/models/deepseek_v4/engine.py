"""The query-suffix engine for the DeepSeek-V4 adapter: many query-row interventions over one cached prefix.

An intervention on ``z`` at the query slot ``q`` cannot change any earlier position. So, per query slot, the
engine prefills ``tokens[:, :q]`` once into a ``transformers.DynamicCache(config=...)`` (in pieces of the
adapter's ``chunk``, as :mod:`.prefill` does; the cache carries V4's sliding windows, compressed entries,
unfinished blocks and CSA overlap halves), runs the clean query row once through every layer, keeping each
layer's input and ``z`` at the query, and then, for each batch of cells at layer ``l``, runs only the query
rows through layers ``l..L-1`` with the cell's ``z`` written at ``blocks.{l}.attn.hook_z``.

**Repeat, not snapshot.** The query call writes into the cache (the window slides, the compressors' buffers
grow, a completed block emits an entry). The engine never lets it write into the clean prefix: for a pass of
``C`` cells over ``n`` rows it hands the model a cache whose layers ``l..L-1`` hold the prefix's tensors
repeated ``C`` times along the batch (row ``c * n + i`` is cell ``c`` on item ``i``). transformers' cache
layers rebind their tensors rather than writing in place, so the repeated tensors are built once per pass
width and shared by every pass of that width; each pass gets shallow copies of the layer objects and dicts.

**The boundary phase.** When ``(q + 1) % S == 0`` the query completes a block: the entry it emits pools the
query's own projections. Because the query row goes through each compressor with the prefix's unfinished
block in the cache, that entry is recomputed from the intervened hidden state in every layer above the
intervention, exactly as in the full forward.

**Attention of the query rows.** transformers' eager attention repeats V4's single key/value head over
all query heads (a ``[B, H, keys, d]`` copy) and then runs ``B * H`` one-row products, which for one query row
costs far more than the arithmetic. During the engine's query passes :func:`query_attention` computes the same
formula (scaled scores, additive mask, per-head sink column, max-subtracted softmax, sink dropped, weights
times values) as one ``[H, d] x [d, keys]`` product per row over the shared head; the prefix prefill runs
transformers' own function. Under ``numerics="reference"`` both run the reference's core
(:func:`~.reference_ops.reference_attention`, itself one product over the shared head). The tests hold both
against full eager forwards.

Exactness: with ``index_topk`` at least the number of entries (``from_transformers(..., index_topk="all")``) every cell
equals the full forward at that cell to float rounding (tested at 1e-5 in fp32). With a binding ``index_topk``
the indexer's top-k of the query row is computed from cached entries whose rounding can differ from an
uncached forward's, so near-tied picks may differ (``docs/deepseek_v4.md`` gives the measured rate).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from phaselens.models.deepseek_v4.prefill import run_prefix
from phaselens.models.deepseek_v4.reference_ops import (
    ReferenceAttention,
    attention_for,
    eager_attention,
    reference_attention,
)
from phaselens.models.deepseek_v4.torch_hooks import torch_sites
from phaselens.models.parts.adapter_hooks import HookRun
from phaselens.models.parts.cache_repeat import CacheRows
from phaselens.models.parts.chunks import plan_chunks
from phaselens.models.parts.suffix_engine import HookList, SlotEngine

# The per-row state of transformers' DeepSeek-V4 cache layers (sliding, CSA, HCA): tensors [B, ...] and dicts of
# them, plus the entry counters (dicts of ints). Anything else batch-shaped is refused.
ROWS = CacheRows(tensor_dicts=("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"),
                 counts=("entry_count",), unknown="this transformers version lays out DeepSeek-V4's cache "
                 "differently. Use engine='full'.")


def query_attention() -> AbstractContextManager[None]:
    """While active, DeepSeek-V4's eager attention runs over the one shared key/value head without
    repeating it per query head (the same formula as transformers' ``eager_attention_forward``); calls with
    several key/value heads, dropout or training mode go to the function it replaced."""

    def shared_head(previous: Callable[..., Any], module: Any, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, scaling: float, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[Tensor, Tensor]:
        if key.shape[1] != 1 or value.shape[1] != 1 or dropout or module.training:
            return attention_for(module, previous)(module, query, key, value, attention_mask, scaling, dropout,
                                                   **kwargs)
        if isinstance(module, ReferenceAttention):  # numerics="reference": the kernel's core, one shared head
            return reference_attention(module, query, key, value, attention_mask, scaling)
        B, H, n, d = query.shape  # key, value: [B, 1, K, d]
        scores = torch.matmul(query.reshape(B, H * n, d), key[:, 0].transpose(1, 2)).view(B, H, n, -1) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        sinks = module.sinks.reshape(1, -1, 1, 1).expand(B, -1, n, -1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(value.dtype)  # the sink dropped
        out = torch.matmul(probs.reshape(B, H * n, -1), value[:, 0]).view(B, H, n, -1)
        return out.transpose(1, 2).contiguous(), probs

    return eager_attention(shared_head)


class V4SuffixEngine(SlotEngine):
    """Clean prefix once; per-cell query passes from the intervened layer up (one query slot).

    The per-slot engine behind :meth:`DeepSeekV4Adapter.query_engine` (grouped by slot by
    :class:`phaselens.models.parts.suffix_engine.QueryEngine`); cells, passes, the clean step and the pass-size budget are
    the shared :class:`~phaselens.models.parts.suffix_engine.SlotEngine`'s. What this kind keeps: the prefill into
    transformers' cache, the repeated copies of its cache layers, and the hooks through :func:`torch_sites`.

    Args (as every :class:`~phaselens.models.parts.suffix_engine.SlotEngine`'s):
        model: a :class:`~phaselens.models.deepseek_v4.DeepSeekV4Adapter` (``self.adapter``).

    Attributes:
        clean_logits: ``[n, V]``; clean_z: per layer ``[n, H, d]`` at the query slot.
    """

    def prefill(self, tokens: Tensor) -> None:
        adapter = self.adapter = self.model
        self.hf = adapter.model
        self.query_ids = tokens[:, self.q : self.q + 1]
        with torch.no_grad():
            plan = plan_chunks(self.q + 1, adapter.chunk, 1)  # the prefix in the adapter's pieces, then the query
            self.cache = run_prefix(self.hf, tokens[:, : self.q + 1], plan, keep_logits=False).cache
            inner = self.hf.model
            embeds = inner.embed_tokens(self.query_ids)  # [n, 1, D]
            self.position_ids = torch.tensor([[self.q]], device=embeds.device)
            self.position_embeddings = {
                kind: inner.rotary_emb(embeds, position_ids=self.position_ids, layer_type=kind)
                for kind in ("main", "compress")
            }
            hidden = embeds.unsqueeze(2).expand(-1, -1, int(self.hf.config.hc_mult), -1).contiguous()
            self.clean_step(hidden, len(inner.layers))
        self.layer_row_bytes = [self._bytes_per_row(layer) for layer in range(len(inner.layers))]

    def run_layers(self, start: int, hidden: Tensor, copies: int, hooks: HookList,
                   record: list[Any] | None = None) -> Tensor:
        """Run the query rows ``hidden`` ``[copies * n, 1, hc, D]`` through layers ``start..L-1`` of the model
        (over a repeated view of the prefix cache) and the head: logits ``[copies * n, V]``."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        sites = self.adapter.resolve_hooks(hooks)  # {name: [fn, ...]}
        inner = self.hf.model
        cache = ROWS.pass_cache(self, self.cache, start, copies)
        ids = self.query_ids.repeat(copies, 1)
        mask = create_sliding_window_causal_mask(config=self.hf.config, inputs_embeds=hidden[:, :, 0],
                                                 attention_mask=None, cache=cache, position_ids=self.position_ids)
        with torch_sites(self.hf, self.adapter._points, sites, HookRun(self.q)), query_attention():
            for layer in inner.layers[start:]:
                if record is not None:
                    record.append(hidden)
                hidden = layer(hidden, position_embeddings=self.position_embeddings,
                               position_ids=self.position_ids, attention_mask=mask, input_ids=ids, cache=cache)
        return self.hf.lm_head(inner.norm(inner.hc_head(hidden)))[:, 0]

    def _bytes_per_row(self, start: int) -> int:
        """Memory per row of a pass from layer ``start``: the repeated cache, and at the longest layer the
        keys (window and entries, concatenated) and a few ``[H, keys]`` score tensors (:func:`query_attention`)."""
        H = int(self.hf.config.num_attention_heads)
        widest = 0
        for layer in self.cache.layers[start:]:
            keys = getattr(layer, "keys", None)
            entries = getattr(layer, "compressed_kv", {}).get("compressor")
            if isinstance(keys, Tensor) and keys.dim() == 4:
                n_keys = keys.shape[2] + 1 + (0 if entries is None else entries.shape[1])
                widest = max(widest, n_keys * (keys.shape[3] + 4 * H) * keys.element_size())
        return ROWS.held(self.cache, start) // max(self.n, 1) + widest
