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

Exactness: with ``index_topk`` at least the number of entries (``from_hf(..., index_topk="all")``) every cell
equals the full forward at that cell to float rounding (tested at 1e-5 in fp32). With a binding ``index_topk``
the indexer's top-k of the query row is computed from cached entries whose rounding can differ from an
uncached forward's, so near-tied picks may differ (``docs/deepseek_v4.md`` gives the measured rate).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from phaselens.core.errors import UnsupportedModelError
from phaselens.models.deepseek_v4.hookpoints import HookFn
from phaselens.models.deepseek_v4.prefill import run_prefix
from phaselens.models.deepseek_v4.reference_ops import (
    CORE_AWARE,
    ReferenceAttention,
    attention_for,
    reference_attention,
)
from phaselens.models.deepseek_v4.torch_hooks import RunInfo, torch_sites
from phaselens.models.numerics.chunks import plan_chunks
from phaselens.runtime.engines import PASS_BYTES, Cell, run_by_layer

# The per-row state of transformers' DeepSeek-V4 cache layers (sliding, CSA, HCA): tensors [B, ...] and
# dicts of them, plus the entry counters (dicts of ints). Anything else batch-shaped is refused.
_TENSORS = ("keys", "values")
_TENSOR_DICTS = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")
_COUNTS = ("entry_count",)


def _repeat(t: Tensor | None, copies: int) -> Tensor | None:
    if t is None or copies == 1 or t.dim() == 0:
        return t
    return t.repeat(copies, *([1] * (t.dim() - 1)))


def repeated_layer(layer: Any, copies: int) -> Any:
    """A copy of one cache layer whose per-row tensors are repeated ``copies`` times along the batch.

    Raises :class:`UnsupportedModelError` if the layer holds state this engine does not know (a transformers
    version that lays out the cache differently): silently sharing it across cells would be wrong.
    """
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if name in _TENSORS:
            setattr(new, name, _repeat(value, copies))
        elif name in _TENSOR_DICTS:
            setattr(new, name, {k: _repeat(v, copies) for k, v in value.items()})
        elif name in _COUNTS:
            setattr(new, name, dict(value))
        elif (isinstance(value, Tensor) and value.dim() > 0) or (
            isinstance(value, dict | list) and any(isinstance(v, Tensor) for v in (value.values() if
                                                                                    isinstance(value, dict) else value))
        ):
            raise UnsupportedModelError(
                f"{type(layer).__name__}.{name} is cache state the query-suffix engine does not know; this "
                "transformers version lays out DeepSeek-V4's cache differently. Use engine='full'."
            )
    if getattr(layer, "values", None) is getattr(layer, "keys", None):  # K = V layers share one tensor
        new.values = new.keys
    return new


@contextmanager
def query_attention() -> Iterator[None]:
    """While active, DeepSeek-V4's eager attention runs over the one shared key/value head without
    repeating it per query head (the same formula as transformers' ``eager_attention_forward``); calls with
    several key/value heads, dropout or training mode go to the function it replaced."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    previous = hf.eager_attention_forward

    def shared_head(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, Tensor]:
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

    setattr(shared_head, CORE_AWARE, True)
    hf.eager_attention_forward = shared_head
    try:
        yield
    finally:
        hf.eager_attention_forward = previous


def _fresh(template: Any) -> Any:
    """A per-pass copy: the forward rebinds the layer's attributes and writes into its dicts."""
    new = copy.copy(template)
    for name in (*_TENSOR_DICTS, *_COUNTS):
        if name in vars(template):
            setattr(new, name, dict(getattr(template, name)))
    return new


class V4SuffixEngine:
    """Clean prefix once; per-cell query passes from the intervened layer up (one query slot).

    The per-slot engine behind :meth:`DeepSeekV4Adapter.query_engine` (grouped by slot by
    :class:`phaselens.runtime.engines.QueryEngine`).

    Args:
        adapter: a :class:`~phaselens.models.deepseek_v4.DeepSeekV4Adapter`.
        tokens: ``[n, T]`` token ids that share the query slot ``query_pos`` (only ``tokens[:, :q + 1]`` is read).
        rows_per_pass: at most this many rows (cells x items) per pass.
        pass_bytes: memory budget of one pass; fewer cells go into a pass where the cache is long.

    Attributes:
        clean_logits: ``[n, V]``; clean_z: per layer ``[n, H, d]`` at the query slot.
    """

    def __init__(self, adapter: Any, tokens: Tensor, query_pos: int, *, rows_per_pass: int = 4096,
                 pass_bytes: int = PASS_BYTES) -> None:
        self.adapter = adapter
        self.hf = adapter.model
        self.q = int(query_pos)
        self.rows_per_pass = int(rows_per_pass)
        self.pass_bytes = int(pass_bytes)
        tokens = adapter._tokens(tokens)
        self.n = int(tokens.shape[0])
        self.query_ids = tokens[:, self.q : self.q + 1]
        self._templates: dict[tuple[int, int], Any] = {}
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
            self.resid_pre, self.clean_z, self.clean_logits = self._clean_step(hidden)
        self._row_bytes = [self._bytes_per_row(layer) for layer in range(len(inner.layers))]

    # ---- passes --------------------------------------------------------------------------------------
    def _z_name(self, layer: int) -> str:
        return f"blocks.{layer}.attn.hook_z"

    def _clean_step(self, hidden: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Per layer, the query's input streams ``[n, 1, hc, D]`` and ``z`` ``[n, H, d]``; clean logits ``[n, V]``."""
        L = len(self.hf.model.layers)
        zs: dict[int, Tensor] = {}

        def keep(z: Tensor, *, hook: Any) -> None:
            zs[hook.layer()] = z[:, 0].clone()

        resid: list[Tensor] = []
        hooks: dict[str, list[HookFn]] = {self._z_name(i): [keep] for i in range(L)}
        with torch_sites(self.hf, self.adapter._points, hooks, RunInfo(self.q, True)):
            logits = self._layers(0, hidden, 1, record=resid)
        return resid, [zs[i] for i in range(L)], logits

    def _layers(self, start: int, hidden: Tensor, copies: int, record: list[Tensor] | None = None) -> Tensor:
        """Run the query rows ``hidden`` ``[copies * n, 1, hc, D]`` through layers ``start..L-1`` of the model
        (over a repeated view of the prefix cache) and the head: logits ``[copies * n, V]``."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        inner = self.hf.model
        cache = self._pass_cache(start, copies)
        ids = self.query_ids.repeat(copies, 1)
        mask = create_sliding_window_causal_mask(config=self.hf.config, inputs_embeds=hidden[:, :, 0],
                                                 attention_mask=None, cache=cache, position_ids=self.position_ids)
        with query_attention():
            for layer in inner.layers[start:]:
                if record is not None:
                    record.append(hidden)
                hidden = layer(hidden, position_embeddings=self.position_embeddings,
                               position_ids=self.position_ids, attention_mask=mask, input_ids=ids, cache=cache)
        return self.hf.lm_head(inner.norm(inner.hc_head(hidden)))[:, 0]

    def _pass_cache(self, start: int, copies: int) -> Any:
        """A cache for one pass: layers below ``start`` are the clean prefix's own (only read, for the mask),
        layers from ``start`` fresh copies of the prefix repeated ``copies`` times."""
        if not any(k[1] == copies for k in self._templates):  # a new pass width: drop the old width's copies
            self._templates = {}
        layers = list(self.cache.layers)
        for i in range(start, len(layers)):
            key = (i, copies)
            if key not in self._templates:
                self._templates[key] = repeated_layer(layers[i], copies)
            layers[i] = _fresh(self._templates[key])
        cache = copy.copy(self.cache)
        cache.layers = layers
        return cache

    def _bytes_per_row(self, start: int) -> int:
        """Memory per row of a pass from layer ``start``: the repeated cache, and at the longest layer the
        keys (window and entries, concatenated) and a few ``[H, keys]`` score tensors (:func:`query_attention`)."""
        H = int(self.hf.config.num_attention_heads)
        cache_bytes, widest = 0, 0
        for layer in self.cache.layers[start:]:
            for name, value in vars(layer).items():
                values = value.values() if name in _TENSOR_DICTS else [value] if name in _TENSORS else []
                cache_bytes += sum(v.numel() * v.element_size() for v in values if isinstance(v, Tensor))
            keys = getattr(layer, "keys", None)
            entries = getattr(layer, "compressed_kv", {}).get("compressor")
            if isinstance(keys, Tensor) and keys.dim() == 4:
                n_keys = keys.shape[2] + 1 + (0 if entries is None else entries.shape[1])
                widest = max(widest, n_keys * (keys.shape[3] + 4 * H) * keys.element_size())
        return cache_bytes // max(self.n, 1) + widest

    @torch.no_grad()
    def run(self, cells: Sequence[Cell], *, progress: Any = None) -> Tensor:
        """Logits at the query slot under each cell: ``[C, n, V]``."""
        def per_pass(layer: int) -> int:  # rows bounded by rows_per_pass and the pass's memory budget
            rows = min(self.rows_per_pass, self.pass_bytes // max(self._row_bytes[layer], 1))
            return max(1, rows // max(self.n, 1))

        return run_by_layer(cells, per_pass, self._pass, progress)

    def _pass(self, layer: int, cells: Sequence[Cell]) -> Tensor:
        n, C = self.n, len(cells)
        z0 = self.clean_z[layer]
        H, d = z0.shape[1:]
        mask = torch.zeros(C, H, dtype=torch.bool)
        repl = torch.zeros(C, n, H, d, dtype=z0.dtype, device=z0.device)
        for c, cell in enumerate(cells):
            heads = list(cell.heads)
            mask[c, heads] = True
            if cell.replacement is not None:
                r = cell.replacement.to(device=repl.device, dtype=repl.dtype)
                repl[c][:, heads] = r if r.dim() == 3 else r.expand(n, -1, -1)
        mask_rows = mask.repeat_interleave(n, 0)[:, None, :, None].to(z0.device)  # [C * n, 1, H, 1]
        repl_rows = repl.reshape(C * n, 1, H, d)

        def intervene(z: Tensor, *, hook: Any) -> Tensor:
            return torch.where(mask_rows, repl_rows, z)

        hidden = self.resid_pre[layer].repeat(C, 1, 1, 1)
        with torch_sites(self.hf, self.adapter._points, {self._z_name(layer): [intervene]}, RunInfo(self.q, True)):
            logits = self._layers(layer, hidden, C)
        return logits.view(C, n, -1)
