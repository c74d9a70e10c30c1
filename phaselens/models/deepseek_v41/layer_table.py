"""DeepSeek-V4.1's layers as data: the :class:`~phaselens.contract.layer_table.LayerTable` of a
:class:`~phaselens.models.deepseek_v41.DeepSeekV41` (a meta-device one will do: only shapes and dtypes are read),
counted from phaselens's own code call by call, as :meth:`DeepSeekV41.forward` and a chunked prefill run.

Memory (``estimate_memory``, :mod:`.memory`):

* weights: every parameter and buffer as held (packed FP8 / FP4 bytes and scales, or dequantized), Engram's
  tables included wherever they are (device maps keep them in host memory: :mod:`.placement`);
* the cache (:class:`V41Cache`): every layer's last ``window - 1`` keys, and per KV source its entries
  (``T // r`` rows of ``head_dim``) with their index keys (``index_head_dim``), and the open group's fp32
  projections;
* attention: a call's fp32 scores ``[B, H, n, window + entries + 1]`` (window, every entry of the layer's source,
  sink: scores are computed for all entries, then masked to the picks); the softmax holds about four;
* the other transients of a call at its largest layer: the window's fp32 unfold ``[B, n, head_dim, window]``,
  about six fp32 copies of the hyper-connection streams ``[B, n, hc, D]``, the indexer's
  ``[B, n, index_heads, entries]`` scores (three copies, model dtype), Engram's looked-up rows
  ``[B, n, C, head_dim]`` (the FP8 bytes sent over, two fp32 and one bf16 copy while dequantizing, the
  model-dtype input of ``wkv``), and packed weights being dequantized (a group of experts,
  ``RoutedExperts.chunk_bytes`` at most, and the largest FP8 projection);
* logits: fp32 ``[B, rows, vocab]``.

Work (``phaselens plan``'s time, :mod:`phaselens.planning.flops`): the matmuls' multiply-adds split by the
precision they run in for a bf16 model (model dtype: the attention projections ``wq_a``, ``wq_b``, ``wkv``,
``wo_a``, ``wo_b``, the ratio-1 compressor, the indexer's ``wq_b``, ``weights_proj``, keys ``wk`` and scores, the
shared expert and the **activated** routed experts, Engram's ``wkv``; fp32: the attention core, the
hyper-connection mixes, the router, the pooling compressor (ratio >= 2) and the head), and the GPU-memory traffic
(a lower-bound estimate): the weights each call reads (routed experts: those its tokens choose), the dequantized
copy of every packed weight it uses (written and read), the cache's entries copied to fp32, about four fp32
score tensors written and read (:data:`SCORE_PASSES`), the window's fp32 unfold, the indexer's scores and
:data:`STREAM_PASSES` fp32 passes over the hyper-connection streams.

Counted from the code's tensors; allocator fragmentation and CUDA's context (~1 GiB) come on top.
"""

from __future__ import annotations

import math
from typing import Any

from phaselens.contract.layer_table import LayerRow, LayerTable, Store, Work
from phaselens.models.numerics.sizing import held_bytes

STREAM_COPIES = 6  # fp32 copies of the hyper-connection streams [B, n, hc, D] alive in one call
STREAM_PASSES = 24  # fp32 passes over the [B, n, hc, D] streams per layer (mixes, Sinkhorn inputs, pre, post)
SCORE_PASSES = 8  # four fp32 score tensors per attention call, each written and read
ENGRAM_ROW_PASSES = 11  # bytes per looked-up element on the GPU besides the model-dtype copy: FP8, 2 x fp32, bf16


def block_bytes(block: Any) -> dict[str, int]:
    """Weight bytes of a V4.1 ``Block`` as held on its GPU (a meta-device one will do), as :class:`Work` fields:
    ``weight_held`` (packed or dense, routed experts excluded), ``weight_dense`` (the dequantized size of its
    packed weights), and per routed expert ``expert_held`` / ``expert_dense`` (0 when the experts are held dense).
    Engram is left out (its table is host memory, its projection counted by Engram's work)."""
    from phaselens.models.deepseek_v41.moe import RoutedExperts

    held = dense = ex_held = ex_dense = 0
    skip = {id(m) for m in block.engram.modules()} if hasattr(block, "engram") else set()
    for m in block.modules():
        if id(m) in skip:
            continue
        own = sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        if isinstance(m, RoutedExperts):
            n = m.shapes["w1"][0]
            ex_held += own // n
            if m.fmt is not None:
                ex_dense += sum(math.prod(s[1:]) for s in m.shapes.values()) * m.dtype.itemsize
            continue
        held += own
        if getattr(m, "fmt", None) is not None:
            dense += math.prod(m.shape) * m.dtype.itemsize
    return dict(weight_held=held, weight_dense=dense, expert_held=ex_held, expert_dense=ex_dense)


def layer_table(model: Any) -> LayerTable:
    """The :class:`LayerTable` of a :class:`~phaselens.models.deepseek_v41.DeepSeekV41`."""
    c = model.config
    item = model.embed.weight.dtype.itemsize
    layout = getattr(model, "engram_layout", None)
    per_token = c.head_dim * c.sliding_window * 4 + STREAM_COPIES * c.hc_mult * c.hidden_size * 4
    if layout is not None:
        per_token += layout.n_cols * layout.head_dim * (ENGRAM_ROW_PASSES + item)
    per_pair = 3 * c.index_n_heads * item if c.index_source_layer_ids else 0
    rows = tuple(_row(model, role, block, item) for role, block in zip(model.roles, model.blocks))
    V, D = int(c.vocab_size), int(c.hidden_size)
    return LayerTable(rows, held_bytes(model), int(c.sliding_window), V, 4, 4, keys="unfold", sink=1,
                      per_token=per_token, per_pair=per_pair, fixed=_dequant(model, item),
                      index_topk=model._index_topk, head_macs_fp32=c.hc_mult * D + D * V, head_weight_bytes=V * D * 4,
                      head_bytes_per_row=V * 4)


def _row(model: Any, role: Any, block: Any, item: int) -> LayerRow:
    c = model.config
    D, H, d, L = c.hidden_size, c.num_attention_heads, c.head_dim, c.sliding_window
    hc, qr, R, G = c.hc_mult, c.q_lora_rank, c.o_lora_rank, c.o_groups
    Hi, di, F, Er, k = c.index_n_heads, c.index_head_dim, c.moe_intermediate_size, c.n_routed_experts, \
        c.num_experts_per_tok
    topk = model._index_topk
    mix = (2 + hc) * hc
    macs = D * qr + qr * H * d + D * d + H * d * R + G * R * D + 3 * D * F * (k + 1)  # projections, experts
    macs_fp32 = 2 * hc * D * mix + 2 * hc * D + 2 * hc * hc * D + D * Er + 2 * H * d * L  # mixes, router, window
    per_token = SCORE_PASSES * H * (L + 1) * 4 + 2 * d * L * 4 + STREAM_PASSES * hc * D * 4
    cache = [Store("window", d, item)]
    extra: dict[str, int] = {}
    r = model.roles[role.kv_source].ratio if role.ratio else 0
    if role.ratio:
        extra.update(macs_fp32_per_score=2 * H * d, bytes_per_score=SCORE_PASSES * H * 4,
                     bytes_per_entry=d * (item + 12))
        if role.is_kv_source:
            cache += [Store("entries", d + di, item, ratio=role.ratio), Store("open", d, 4, copies=2, ratio=role.ratio)]
            if r == 1:
                macs += D * d
            else:
                macs_fp32 += 2 * D * d
            extra["macs_per_new_entry"] = d * di  # the new entries' index keys
        if role.is_index_source and topk is not None:
            macs += qr * Hi * di + D * Hi
            extra.update(macs_per_pair=Hi * di, bytes_per_pair=4 * Hi * item,
                         bytes_per_entry=extra["bytes_per_entry"] + di * item)
    if hasattr(block, "engram"):
        extra.update(_engram(model, block.engram, item))
    work = Work(macs=macs, macs_fp32=macs_fp32, **block_bytes(block), n_experts=Er, experts_per_token=k,
                bytes_per_token=per_token, **extra)
    return LayerRow(role.layer, "sliding" if role.ratio == 0 else f"ratio {role.ratio}", H, d, ratio=role.ratio,
                    entry_ratio=r, makes_entries=bool(role.ratio and role.is_kv_source),
                    picks=bool(role.ratio and role.is_index_source), cache=tuple(cache), work=work)


def _engram(model: Any, module: Any, item: int) -> dict[str, int]:
    """Engram of one layer: ``wkv`` over the looked-up rows (model dtype) and the rows sent from the host."""
    from phaselens.models.deepseek_v41.engram import engram_traffic

    c = model.config
    t = engram_traffic(c)
    cols, out = module.wkv.shape[1], module.wkv.shape[0]
    w = sum(p.numel() * p.element_size() for p in module.wkv.parameters())
    dense = 2 * out * cols * item if module.wkv.fmt is not None else 0
    return dict(engram_macs=cols * out, engram_weight_bytes=w + dense, engram_rows=t.rows_per_token,
                engram_row_bytes=c.engram_head_dim * (ENGRAM_ROW_PASSES + item), engram_host_row_bytes=t.row_bytes)


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


__all__ = ["SCORE_PASSES", "STREAM_PASSES", "block_bytes", "layer_table"]
