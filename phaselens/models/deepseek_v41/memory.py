"""Memory a DeepSeek-V4.1 forward needs, from the model's sizes alone (a meta-device model will do).

:func:`estimate_memory` counts, in bytes, for ``batch`` sequences of ``tokens`` tokens run as
:meth:`DeepSeekV41.forward` runs them (optionally prefilled in pieces of ``chunk``):

* ``weights``: every parameter and buffer as held (packed FP8 / FP4 bytes and scales, or dequantized),
  Engram's tables included wherever they are (device maps keep them in host memory: see
  :mod:`~phaselens.models.deepseek_v41.device_maps`);
* ``cache``: the :class:`V41Cache` after the run: every layer's last ``window - 1`` keys, and per KV source
  its entries (``T // r`` rows of ``head_dim``), index keys (``T // r`` rows of ``index_head_dim``) and the open
  group's fp32 projections;
* ``attention``: the largest fp32 score tensor one call builds, ``[B, H, n, window + entries + 1]`` (window,
  every entry of the layer's source, sink: scores are computed for all entries, then masked to the picks).
  The softmax holds about four such tensors at once (scores, masked scores, concatenation, probabilities), so
  budget four times it, as for DeepSeek-V4;
* ``activations``: the rest of one call's transients at its largest layer: the window's fp32 unfold
  ``[B, n, head_dim, window]``, about six fp32 copies of the hyper-connection streams ``[B, n, hc, D]``, the
  indexer's ``[B, n, index_heads, entries]`` scores (three copies, model dtype), and packed weights being
  dequantized (a group of experts, ``RoutedExperts.chunk_bytes`` at most, and the largest FP8 projection) and
  Engram's looked-up rows ``[B, n, C, head_dim]`` (the FP8 bytes sent over, two fp32 and one bf16 copy while
  dequantizing, and the model-dtype input of ``wkv``);
* ``logits``: the returned logits, fp32 ``[B, rows, vocab]``.

Counted from the code's tensors; allocator fragmentation and CUDA's context (~1 GiB) come on top.
"""

from __future__ import annotations

from typing import Any, Literal

from phaselens.contract.memory import MemoryEstimate
from phaselens.models.numerics.sizing import held_bytes, item_size
from phaselens.models.parts.chunks import plan_chunks


def estimate_memory(model: Any, tokens: int, *, batch: int = 1, chunk: int | None = None,
                    query_len: int | None = None, logits: Literal["all", "query"] = "all") -> MemoryEstimate:
    """Estimate the memory of ``model(tokens, chunk=chunk, query_len=query_len, logits=logits)``."""
    c = model.config
    T, B = int(tokens), int(batch)
    plan = plan_chunks(T, chunk, query_len if chunk is not None else None)  # unchunked: one call
    item = item_size(model.embed.weight.dtype)
    attention = max(_scores(model, a, b, B) for a, b in plan.calls)
    activations = max(_transients(model, a, b, B, item) for a, b in plan.calls) + _dequant(model, item)
    rows = T if logits == "all" else plan.query_rows if chunk else int(query_len or T)
    return MemoryEstimate(T, B, chunk, plan.query_rows, held_bytes(model), _cache(model, T, B, item),
                          attention, logits=B * rows * int(c.vocab_size) * 4, activations=activations)


def _entries(model: Any, stop: int) -> int:
    """Most entries any layer attends at slot ``stop`` (every entry of its source so far)."""
    return max((stop // r.ratio for r in model.roles if r.ratio), default=0)


def _scores(model: Any, start: int, stop: int, B: int) -> int:
    c = model.config
    return B * c.num_attention_heads * (stop - start) * (c.sliding_window + _entries(model, stop) + 1) * 4


def _transients(model: Any, start: int, stop: int, B: int, item: int) -> int:
    c = model.config
    n = stop - start
    window = B * n * c.head_dim * c.sliding_window * 4
    streams = 6 * B * n * c.hc_mult * c.hidden_size * 4
    index = 3 * B * n * c.index_n_heads * _entries(model, stop) * item if c.index_source_layer_ids else 0
    layout = getattr(model, "engram_layout", None)
    engram = B * n * layout.n_cols * layout.head_dim * (1 + 4 + 4 + 2 + item) if layout is not None else 0
    return window + streams + index + engram


def _dequant(model: Any, item: int) -> int:
    """Dequantized bytes alive while a packed layer runs: a group of experts and the largest projection."""
    from phaselens.models.deepseek_v41.layers import Linear
    from phaselens.models.deepseek_v41.moe import RoutedExperts

    experts = linear = 0
    for m in model.modules():
        if isinstance(m, RoutedExperts) and m.fmt is not None:
            n, rows, cols = m.shapes["w1"]
            experts = max(experts, min(m.chunk_bytes, n * 3 * rows * cols * item))
        elif isinstance(m, Linear) and m.fmt is not None:
            linear = max(linear, m.shape[0] * m.shape[1] * item)
    return experts + linear


def _cache(model: Any, T: int, B: int, item: int) -> int:
    c = model.config
    total = len(model.roles) * min(T, c.sliding_window - 1) * c.head_dim * item
    for r in model.roles:
        if r.is_kv_source:
            entries = T // r.ratio
            pending = (T % r.ratio) * c.head_dim * 4 * 2
            total += entries * (c.head_dim + c.index_head_dim) * item + pending
    return B * total
