"""Gate weights of DeepSeek-V4's compressor, rebuilt from the hooked ``kv_proj`` / ``gate_proj`` outputs.

For entry ``j`` of a compressed layer of stride S and window W (science.md §2)::

    alpha_j = softmax over slots i of (gate_proj(h) + position_bias)   per channel, fp32
    row_j   = RoPE_{jS}( kv_norm( sum_i alpha_{j,i} * kv_proj(h)_i ) )

HCA (W = S): slot i of entry j is token ``jS + i``. CSA (W = 2S): the projections have 2d channels split
``Ca | Cb``; slots ``0..S-1`` hold the Ca half of the previous block, slots ``S..2S-1`` the Cb half of the
block itself, and entry 0's previous-block slots get weight 0 (logit -inf, payload 0).

Under a cache (chunked prefill) the compressor carries tokens of an unfinished block in
``buffer_kv/buffer_gate`` and the last complete block's Ca half in ``overlap_kv/overlap_gate`` (stored
with the bias already added); :func:`snapshot` reads them before the call so the windows of entries that
straddle the chunk boundary are complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

_NAME = "compressor"  # the cache slot of the main compressor (the indexer's is "indexer")


@dataclass(frozen=True)
class Snapshot:
    """A compressor's cache state before one call (``None`` fields: nothing stored yet)."""

    buffer_kv: Tensor | None = None
    buffer_gate: Tensor | None = None
    overlap_kv: Tensor | None = None
    overlap_gate: Tensor | None = None
    entry_count: int = 0


def snapshot(cache: Any, layer: int) -> Snapshot:
    """Read layer ``layer``'s compressor state out of a transformers DeepSeek-V4 cache (empty if no cache)."""
    if cache is None:
        return Snapshot()
    state = cache.layers[layer]
    overlap_kv = getattr(state, "overlap_kv", {}).get(_NAME)
    overlap_gate = getattr(state, "overlap_gate", {}).get(_NAME)
    # Tensors are rebound, never written in place, by the cache: holding the references is a snapshot.
    return Snapshot(
        state.buffer_kv[_NAME],
        state.buffer_gate[_NAME],
        overlap_kv,
        overlap_gate,
        int(state.entry_count[_NAME]),
    )


@dataclass(frozen=True)
class Windows:
    """Gate weights and payloads of the entries completed in one call.

    ``alpha`` and ``payload`` are ``[B, E_new, W, 1, d]`` (one latent, per-channel gates); ``first_entry`` is
    the index of entry 0 of this call.
    """

    alpha: Float[Tensor, "batch entry slot 1 d"]
    payload: Float[Tensor, "batch entry slot 1 d"]
    first_entry: int

    @property
    def n_entries(self) -> int:
        return int(self.alpha.shape[1])


def windows(module: nn.Module, kv: Tensor, gate: Tensor, before: Snapshot) -> Windows:
    """Rebuild the windows of the entries one compressor call completes.

    Args:
        module: a transformers ``DeepseekV4CSACompressor`` or ``DeepseekV4HCACompressor``.
        kv, gate: that call's ``kv_proj`` / ``gate_proj`` outputs ``[B, n, C]`` (C = 2d for CSA, d for HCA).
        before: the compressor's cache state before the call.
    """
    S, d = int(module.compress_rate), int(module.head_dim)
    overlap = hasattr(module, "indexer")  # CSA compressors own an indexer; HCA ones do not
    if before.buffer_kv is not None and before.buffer_kv.shape[1]:
        kv = torch.cat([before.buffer_kv, kv], dim=1)
        gate = torch.cat([before.buffer_gate, gate], dim=1)
    B = kv.shape[0]
    E = kv.shape[1] // S
    blocks_kv = kv[:, : E * S].reshape(B, E, S, kv.shape[-1])  # explicit width: E may be 0
    blocks_gate = gate[:, : E * S].reshape(B, E, S, gate.shape[-1]) + module.position_bias
    if not overlap:
        logits, payload = blocks_gate, blocks_kv
    else:
        logits = blocks_gate.new_full((B, E, 2 * S, d), float("-inf"))
        payload = blocks_kv.new_zeros((B, E, 2 * S, d))
        logits[:, :, S:], payload[:, :, S:] = blocks_gate[..., d:], blocks_kv[..., d:]
        logits[:, 1:, :S], payload[:, 1:, :S] = blocks_gate[:, :-1, :, :d], blocks_kv[:, :-1, :, :d]
        if E and before.overlap_kv is not None:  # entry 0 of this call reads the previous call's last block
            logits[:, 0, :S] = before.overlap_gate.to(logits.dtype)
            payload[:, 0, :S] = before.overlap_kv.to(payload.dtype)
    # fp32 softmax per channel over the slots, cast back to the payload dtype, as the model does.
    alpha = logits.softmax(dim=2, dtype=torch.float32).to(payload.dtype)
    return Windows(alpha.unsqueeze(3), payload.unsqueeze(3), before.entry_count)


def pool(alpha: Tensor, payload: Tensor) -> Float[Tensor, "batch entry d"]:
    """``sum_i alpha_i * payload_i`` over the slots: ``[B, E, W, 1, d]`` twice -> ``[B, E, d]``."""
    return (payload * alpha).sum(dim=2).squeeze(2)


def finish(
    module: nn.Module, pooled: Float[Tensor, "batch entry d"], first_entry: int
) -> Float[Tensor, "batch entry d"]:
    """``kv_norm`` then RoPE at slot ``jS`` (the first slot of each entry's own block), with the module's own
    norm and rotary embedding: the rows the compressor emits."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    rows = module.kv_norm(pooled)
    B, E = rows.shape[:2]
    S = int(module.compress_rate)
    positions = ((torch.arange(E, device=rows.device) + first_entry) * S).unsqueeze(0).expand(B, -1)
    cos, sin = module.rotary_emb(rows, position_ids=positions, layer_type=module.rope_layer_type)
    return apply_rotary_pos_emb(rows.unsqueeze(1), cos, sin).squeeze(1)
