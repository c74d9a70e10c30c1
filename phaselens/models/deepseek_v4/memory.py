"""Memory a DeepSeek-V4 forward needs, from the model's sizes alone (a meta-device model will do).

:func:`estimate_memory` counts, in bytes, for ``batch`` sequences of ``tokens`` tokens run as the adapter runs
them (optionally prefilled in chunks, see :mod:`.prefill`):

* ``weights``: every parameter and buffer, at the dtype the model holds it in;
* ``cache``: the ``DynamicCache`` after the run: per layer the sliding window (the last ``L - 1`` keys; sliding
  layers keep keys and values as two tensors, compressed layers one, K = V), the compressed entries
  (``T // S`` rows of ``head_dim``), in CSA layers the indexer's keys (``T // S`` rows of ``index_head_dim``),
  and the compressors' unfinished block and overlap half (a few rows);
* ``attention``: the largest attention-probability tensor one call builds, ``[B, H, n, keys]`` with
  ``keys = cached window + n + entries``, in the model dtype. Eager attention holds a few transient tensors of
  this size at once (logits, masked logits, softmax), so budget about four times it; under
  ``numerics="reference"`` in half precision the scores and their exponentials are fp32, as in DeepSeek's
  kernel: budget about five times;
* ``logits``: the returned logits, ``[B, T, vocab]`` (or ``[B, query_len, vocab]`` with ``logits="query"``),
  fp32 when the head runs in fp32 (``numerics="reference"``).

Sizes are the tensors' own (``numel * itemsize``); a window slice may keep the storage of its last call's
concatenation (up to one chunk more rows) alive.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from phaselens.contract.memory import MemoryEstimate
from phaselens.models.deepseek_v4.config import unwrap
from phaselens.models.deepseek_v4.geometry import LayerGeometry, layer_geometry
from phaselens.models.deepseek_v4.numerics import Fp32Projection
from phaselens.models.deepseek_v4.packed_modules import is_packed
from phaselens.models.numerics.sizing import held_bytes, item_size
from phaselens.models.parts.chunks import plan_chunks


def estimate_memory(
    model: Any,
    tokens: int,
    *,
    batch: int = 1,
    chunk: int | None = None,
    query_len: int | None = None,
    logits: Literal["all", "query"] = "all",
) -> MemoryEstimate:
    """Estimate the memory of ``adapter(tokens, chunk=chunk, query_len=query_len, logits=logits)``.

    Args:
        model: a :class:`DeepSeekV4Adapter` or a transformers ``DeepseekV4ForCausalLM`` (weights may be on the
            meta device: only shapes and dtypes are read).
        tokens: sequence length ``T``; batch: sequences per call; chunk, query_len, logits: as the adapter's,
            except that ``chunk=None`` with a ``query_len`` counts the prefix as one cached call and then the
            query (:func:`~phaselens.models.parts.chunks.plan_chunks`: the query engine's prefill, which
            ``runtime.planning`` prices this way), where the adapter's own forward is one uncached call.
    """
    hf = model.model if hasattr(model, "layer_geometry") else unwrap(model)[0]
    geometry = layer_geometry(hf.config)
    plan = plan_chunks(int(tokens), chunk, query_len)
    weights = held_bytes(hf)
    attention = max(_probs(hf, geometry, start, stop, batch) for start, stop in plan.calls)
    emb = hf.get_input_embeddings().weight
    rows = tokens if logits == "all" else plan.query_rows
    head = 4 if isinstance(hf.lm_head, Fp32Projection) else item_size(hf.lm_head.weight.dtype)
    n_logits = batch * rows * int(hf.config.vocab_size) * head
    cache = sum(_cache_bytes(hf, g, int(tokens), batch, emb.dtype) for g in geometry) if plan.prefix else 0
    return MemoryEstimate(
        int(tokens), batch, chunk, plan.query_rows, weights, cache, attention, n_logits
    )


def _probs(hf: nn.Module, geometry: list[LayerGeometry], start: int, stop: int, batch: int) -> int:
    """Largest ``[B, H, n, keys]`` attention-probability tensor of the call on tokens ``start..stop``."""
    config = hf.config
    n, L = stop - start, int(config.sliding_window)
    raw = min(start, L - 1) + n  # the cached window's keys, then this call's own
    entries = max((stop // g.spec.stride if g.spec else 0) for g in geometry)  # all entries up to `stop`
    item = item_size(hf.get_input_embeddings().weight.dtype)
    return batch * int(config.num_attention_heads) * n * (raw + entries) * item


def _cache_bytes(hf: nn.Module, g: LayerGeometry, T: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of layer ``g``'s cache after ``T`` tokens (the window, entries, buffers, overlap halves)."""
    config = hf.config
    d, L = int(config.head_dim), int(config.sliding_window)
    item = item_size(dtype)
    window = min(T, L - 1) * d * item * (2 if g.spec is None else 1)  # sliding layers: K and V separately
    if g.spec is None:
        return batch * window
    S = g.spec.stride
    comp = hf.model.layers[g.layer].self_attn.compressor
    total = window + _compressor_bytes(comp, T, S, d, item, overlap=g.kind == "csa")
    if g.kind == "csa":
        total += _compressor_bytes(comp.indexer, T, S, int(config.index_head_dim), item, overlap=True)
    return batch * total


def _compressor_bytes(module: nn.Module, T: int, S: int, d: int, item: int, *, overlap: bool) -> int:
    """Entries ``[T // S, d]``, the unfinished block's projections ``[T % S, C]`` (kv and gate, C = 2d with
    overlap) and, with overlap, the last block's ``Ca`` half ``[S, d]`` (kv, and gate with the fp32 bias added)."""
    proj = 4 if isinstance(module.kv_proj, Fp32Projection) else item if is_packed(module.kv_proj) else item_size(
        module.kv_proj.weight.dtype)
    width = (2 if overlap else 1) * d
    total = (T // S) * d * item + 2 * (T % S) * width * proj
    if overlap and T >= S:
        total += S * d * proj + S * d * 4
    return total
