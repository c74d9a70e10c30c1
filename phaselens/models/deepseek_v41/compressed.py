"""The compressed path of a V4.1 layer: the compressor (at KV sources), the indexer (at index sources) and
the candidate filter (at the candidate source).

* ratio ``r >= 2``: each channel of the latent pools ``r`` consecutive tokens with softmax weights over the
  ``r`` gate logits (fp32, no overlap, no position bias); entry ``j`` covers slots ``jr .. jr + r - 1``.
* ratio 1: entry ``j`` is the normed projection of token ``j`` (model dtype, no gate).
* entries are RoPE'd at slot ``jr`` (the group's first token); index keys come from the latent *before*
  RoPE, through ``wk`` and ``k_norm``, RoPE'd at ``jr`` too.
* entry ``j`` is visible at slot ``t`` iff ``j < (t + 1) // r``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn

from phaselens.core import margins
from phaselens.models.deepseek_v41.layers import Linear, Numerics
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.norms import RMSNorm
from phaselens.models.parts.numerics_deepseek import index_scores


class Compressor(nn.Module):
    """``wkv`` (and ``wgate`` when ``ratio > 1``) ``[d, D]`` plus the latent's RMSNorm (checkpoint names)."""

    def __init__(self, d_model: int, d: int, ratio: int, eps: float, numerics: Numerics, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = ratio
        # the reference promotes the pooling weights to fp32; the ratio-1 projection stays in the model dtype
        wdt = compute_dtype(dtype) if ratio > 1 else dtype
        self.wkv = Linear(d_model, d, numerics, quantized=False, dtype=wdt)
        if ratio > 1:
            self.wgate = Linear(d_model, d, numerics, quantized=False, dtype=wdt)
        self.norm = RMSNorm(d, eps, dtype)


class Indexer(nn.Module):
    """Query side at every index source (``wq_b``, ``weights_proj``); key side (``wk``, ``k_norm``) only at KV
    sources, whose index keys later index sources of the same source read."""

    def __init__(self, cfg, numerics: Numerics, dtype: torch.dtype, *, owns_keys: bool, has_queries: bool) -> None:
        super().__init__()
        Hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.head_dim = Hi, di
        if has_queries:
            self.wq_b = Linear(cfg.q_lora_rank, Hi * di, numerics, quantized=True, dtype=dtype, stored="fp8")
            self.weights_proj = Linear(cfg.hidden_size, Hi, numerics, quantized=False, dtype=dtype)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, di, numerics, quantized=False, dtype=dtype)
            self.k_norm = RMSNorm(di, cfg.rms_norm_eps, dtype)

    def scores(
        self, x: Tensor, q: Float[Tensor, "batch pos head d"], keys: Float[Tensor, "batch entry d"]
    ) -> Float[Tensor, "batch pos entry"]:
        """``sum_h w_h(x) relu(q_h . k_e)`` with ``w = weights_proj(x) / sqrt(d_index * H_index)``, computed in
        the model dtype as the reference does."""
        return index_scores(q, keys, self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5))


def visible(positions: Tensor, n_entries: int, ratio: int) -> Bool[Tensor, "pos entry"]:
    """Entry ``j`` is visible at slot ``t`` iff ``j < (t + 1) // ratio`` (its group is complete)."""
    lens = torch.div(positions + 1, ratio, rounding_mode="floor")
    return torch.arange(n_entries, device=positions.device) < lens[:, None]


def select_candidate_blocks(
    scores: Float[Tensor, "batch pos entry"], lens: Tensor, topk_blocks: int, block_size: int
) -> Bool[Tensor, "batch pos entry"]:
    """The candidate filter: keep the ``topk_blocks`` blocks of ``block_size`` entries with the best maximum
    score, always keeping the block of each query's newest visible entry (``lens`` ``[pos]`` visible counts).

    ``scores`` must be ``-inf`` where an entry is not visible; blocks with no visible entry are never kept.
    """
    E = scores.shape[-1]
    blocks = F.pad(scores, (0, -E % block_size), value=float("-inf")).unflatten(-1, (-1, block_size)).amax(-1)
    nb = blocks.shape[-1]
    newest = torch.div(lens - 1, block_size, rounding_mode="floor")  # -1 (no block) when nothing is visible
    blocks = blocks.masked_fill(torch.arange(nb, device=scores.device) == newest[:, None], float("inf"))
    values, indices = stable_topk(blocks, min(topk_blocks, nb))
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[..., :E]


def stable_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` of the ``k`` largest along the last axis, ties broken toward the lower index.

    The reference uses ``torch.topk``, whose order among equal scores is unspecified (and differs between a
    parallel forward and decoding, where rows have different lengths). Scores tie exactly in practice (the
    indexer's ReLU zeroes whole rows of head scores), so phaselens fixes the rule to keep the cached and
    parallel paths identical.
    """
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    if margins.active() is not None:
        margins.note_topk(values, k, sorted_desc=True)
    return values[..., :k], indices[..., :k]


def topk_picks(scores: Float[Tensor, "batch pos entry"], k: int) -> Tensor:
    """Indices ``[B, n, min(k, E)]`` of the best finite scores per query, ascending, ``-1`` padding at the end."""
    E = scores.shape[-1]
    values, indices = stable_topk(scores, min(k, E))
    idx = torch.where(values > float("-inf"), indices, E)  # E sorts after every real index
    idx = idx.sort(dim=-1).values
    return torch.where(idx == E, -1, idx)


def picks_mask(picks: Tensor, n_entries: int) -> Bool[Tensor, "batch pos entry"]:
    """``[B, n, k]`` entry indices (``-1`` = none) -> a ``[B, n, E]`` mask."""
    B, n, _ = picks.shape
    idx = torch.where((picks >= 0) & (picks < n_entries), picks, n_entries).long()
    out = torch.zeros(B, n, n_entries + 1, dtype=torch.bool, device=picks.device)
    return out.scatter_(2, idx, True)[..., :n_entries]
