"""One V4.1 attention layer: latent MQA over a sliding window plus (at compressed layers) the shared entries
its indexer (or the latest index source) picked, and a per-head sink, in one softmax.

Data flow (reference ``Attention.forward``; shapes ``B`` batch, ``n`` new positions, ``H`` heads, ``d`` head
dim): ``qr = q_norm(wq_a x)``, ``q = wq_b qr`` (RoPE on the trailing rope dims, no per-head norm);
window KV ``kv = kv_norm(wkv x)`` (RoPE, FP8 round trip over the whole vector under ``quantize``); the
compressed path (:mod:`.compressed`); one softmax over ``[window | picked entries | sink]`` with K = V;
conjugate RoPE on the output; grouped ``wo_a`` (block-diagonal over ``o_groups``), then ``wo_b``.
Layers with a compression ratio use ``compress_rope_theta`` with YaRN, sliding layers ``rope_theta``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from phaselens.models.deepseek_v41.cache import SourceState, StackRuntime, V41Cache
from phaselens.models.deepseek_v41.compressed import (
    Compressor,
    Indexer,
    picks_mask,
    select_candidate_blocks,
    topk_picks,
    visible,
)
from phaselens.models.deepseek_v41.config import LayerRole, V41Config
from phaselens.models.deepseek_v41.layers import GroupedLinear, Linear, Numerics, rope
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.formats import fp4_round_trip, fp8_round_trip
from phaselens.models.parts.hooking import read_only
from phaselens.models.parts.norms import RMSNorm
from phaselens.models.parts.rope import inverse_frequencies
from phaselens.models.parts.tl_factored import FactoredAttentionNames

NEG_INF = float("-inf")


def layer_inv_freq(cfg: V41Config, role: LayerRole) -> Tensor:
    """RoPE inverse frequencies ``[qk_rope_head_dim // 2]`` of a layer: ``compress_rope_theta`` with YaRN where it
    compresses, plain ``rope_theta`` where it slides."""
    if role.compressed:
        return inverse_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, factor=cfg.rope_factor,
                                   original=cfg.rope_original_max_position, beta_fast=cfg.beta_fast,
                                   beta_slow=cfg.beta_slow)
    return inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta)


class V41Attention(FactoredAttentionNames, nn.Module):
    """Attention of layer ``role.layer``; parameter names follow the checkpoint (``attn.wq_a.weight``, ...)."""

    def __init__(self, cfg: V41Config, role: LayerRole, numerics: Numerics, dtype: torch.dtype, *,
                 index_topk: int | None) -> None:
        super().__init__()
        self.role, self.numerics = role, numerics
        self.layer, self.ratio = role.layer, role.ratio
        H, d, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.n_heads, self.head_dim, self.rope_dims = H, d, cfg.qk_rope_head_dim
        self.window, self.groups, self.o_rank = cfg.sliding_window, cfg.o_groups, cfg.o_lora_rank
        self.index_topk = index_topk  # None: every visible entry, no candidate filter
        self.cand_blocks, self.cand_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        ct = compute_dtype(dtype)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=ct))
        fp8 = {"quantized": True, "dtype": dtype, "stored": "fp8"}  # FP8 in the release, FP8 GEMMs in the reference
        self.wq_a = Linear(D, cfg.q_lora_rank, numerics, **fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.wq_b = Linear(cfg.q_lora_rank, H * d, numerics, **fp8)
        self.wkv = Linear(D, d, numerics, **fp8)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        # block-diagonal over o_groups; stored FP8, but an einsum with no activation round trip (reference)
        self.wo_a = GroupedLinear(H * d, cfg.o_groups, cfg.o_lora_rank, numerics, dtype=dtype, stored="fp8")
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, numerics, **fp8)
        if role.is_kv_source:
            self.compressor = Compressor(D, d, role.ratio, cfg.rms_norm_eps, numerics, dtype)
        if role.is_kv_source or role.is_index_source:
            self.indexer = Indexer(cfg, numerics, dtype, owns_keys=role.is_kv_source, has_queries=role.is_index_source)
        self.register_buffer("inv_freq", layer_inv_freq(cfg, role), persistent=False)
        # hook points in execution order (nnsight reads them in that order)
        self.hook_q, self.hook_kv = HookPoint(), HookPoint()
        if role.is_kv_source:
            if role.ratio > 1:
                self.hook_gate = HookPoint()
            self.hook_payload, self.hook_entry = HookPoint(), HookPoint()
        if role.is_candidate_source:
            self.hook_candidates = HookPoint()
        if role.is_index_source:
            self.hook_indexer_topk = HookPoint()
        self.hook_pattern_local = HookPoint()
        if role.compressed:
            self.hook_pattern_entry = HookPoint()
        self.hook_pattern_sink, self.hook_z = HookPoint(), HookPoint()

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, x: Tensor, start: int, cache: V41Cache, rt: StackRuntime) -> Tensor:
        """``x`` ``[B, n, D]`` (normed) at slots ``start..start+n-1`` -> ``[B, n, D]``."""
        B, n, _ = x.shape
        H, d = self.n_heads, self.head_dim
        pos = torch.arange(start, start + n, device=x.device)
        qr = self.q_norm(self.wq_a(x))
        q = self.hook_q(self.wq_b(qr).unflatten(-1, (H, d)))
        q = rope(q, pos, self.inv_freq)
        kv = self.hook_kv(self.kv_norm(self.wkv(x)).unsqueeze(2)).squeeze(2)
        kv = rope(kv, pos, self.inv_freq)
        if self.numerics.kv:
            kv = fp8_round_trip(kv, 32)
        past = cache.window.get(self.layer)
        keys = kv if past is None else torch.cat([past, kv], dim=1)
        cache.stage_window(self.layer, keys[:, max(0, keys.shape[1] - self.window + 1) :])  # the last L - 1 rows
        entries = mask = None
        if self.ratio:
            if self.role.is_kv_source:
                self._compress(x, start, cache, rt)
            # shared state may come from a layer on another device (device_map): read it here
            entries = rt.entries[self.role.kv_source].to(x.device)
            if self.role.is_index_source:
                rt.picks[self.layer] = self._index(x, qr, pos, entries.shape[1], rt)
            mask = rt.picks[self.role.index_source].to(x.device)
        o = self._attend(q, keys, pos, entries, mask)
        o = rope(o, pos, self.inv_freq, inverse=True)
        o = self.hook_z(o)
        return self.wo_b(self.wo_a(o.flatten(2)).flatten(2))

    def _attend(self, q: Tensor, keys: Tensor, pos: Tensor, entries: Tensor | None, mask: Tensor | None) -> Tensor:
        """One softmax over the window, the picked entries and the sink; fp32 scores and probabilities."""
        B, n, H, d = q.shape
        L = self.window
        ct = compute_dtype(q.dtype)
        scale = d**-0.5
        qf = q.to(ct)
        # window of query i: slots pos_i - L + 1 .. pos_i, gathered as a strided view of the padded keys
        padded = F.pad(keys, (0, 0, L - keys.shape[1] + n - 1, 0))
        win = padded.unfold(1, L, 1).to(ct)  # [B, n, d, L]
        slot_ok = (pos[:, None] - (L - 1) + torch.arange(L, device=q.device)) >= 0
        logits_w = torch.einsum("bnhd,bndl->bhnl", qf, win).mul(scale).masked_fill(~slot_ok, NEG_INF)
        parts = [logits_w]
        ent = None
        if entries is not None:
            ent = entries.to(ct)
            logits_e = torch.einsum("bnhd,bed->bhne", qf, ent).mul(scale)
            parts.append(logits_e.masked_fill(~mask[:, None], NEG_INF))
        parts.append(self.attn_sink.to(ct)[None, :, None, None].expand(B, H, n, 1))
        probs = torch.cat(parts, dim=-1).softmax(-1)
        p_w = probs[..., :L]
        o = torch.einsum("bhnl,bndl->bnhd", p_w, win)
        p_e = None
        if ent is not None:
            p_e = probs[..., L : L + ent.shape[1]]
            o = o + torch.einsum("bhne,bed->bnhd", p_e, ent)
        # read-only (sites.py): called after the output is computed; an edit raises rather than being ignored
        read_only(self.hook_pattern_local, p_w)
        if p_e is not None:
            read_only(self.hook_pattern_entry, p_e)
        read_only(self.hook_pattern_sink, probs[..., -1])
        return o.to(q.dtype)

    # ---- compressed path ---------------------------------------------------------------------------
    def _compress(self, x: Tensor, start: int, cache: V41Cache, rt: StackRuntime) -> None:
        """New entries and index keys of this KV source, appended to its cached ones (staged)."""
        comp, r = self.compressor, self.ratio
        old = cache.sources.get(self.layer)
        B, n, _ = x.shape
        if r == 1:
            payload = comp.wkv(x)
            payload = self.hook_payload(payload[:, :, None, None, :]).flatten(2)
            latent = comp.norm(payload)
            first = start
            pend_kv = pend_score = payload.new_zeros(B, 0, payload.shape[-1])
        else:
            ct = compute_dtype(x.dtype)
            xf = x.to(ct)  # the pooling projections are fp32 (Compressor)
            kv_new, score_new = comp.wkv(xf), comp.wgate(xf)
            if old is not None:
                kv_new = torch.cat([old.pending_kv, kv_new], dim=1)
                score_new = torch.cat([old.pending_score, score_new], dim=1)
            G = kv_new.shape[1] // r
            pend_kv, pend_score = kv_new[:, G * r :], score_new[:, G * r :]
            payload = kv_new[:, : G * r].unflatten(1, (G, r))
            alpha = score_new[:, : G * r].unflatten(1, (G, r)).softmax(dim=2)
            first = start // r
            alpha = self.hook_gate(alpha.unsqueeze(3)).squeeze(3)
            payload = self.hook_payload(payload.unsqueeze(3)).squeeze(3)
            latent = comp.norm((alpha * payload).sum(2).to(x.dtype))
        epos = (first + torch.arange(latent.shape[1], device=x.device)) * r
        idx = self.indexer
        k = rope(idx.k_norm(idx.wk(latent)), epos, self.inv_freq)
        entry = rope(latent, epos, self.inv_freq)
        if self.numerics.kv:
            k = fp4_round_trip(k, 32, "ue8m0")
            entry = fp4_round_trip(entry, 16, "e4m3")
        entry = self.hook_entry(entry.unsqueeze(2)).squeeze(2)
        if old is not None:
            entry = torch.cat([old.entries, entry.to(old.entries.dtype)], dim=1)
            k = torch.cat([old.index_keys, k.to(old.index_keys.dtype)], dim=1)
        cache.stage_source(self.layer, SourceState(entry, k, pend_kv, pend_score))
        rt.entries[self.layer], rt.index_keys[self.layer] = entry, k

    def _index(self, x: Tensor, qr: Tensor, pos: Tensor, E: int, rt: StackRuntime) -> Tensor:
        """This index source's picks ``[B, n, E]`` (bool); publishes the candidate mask at the candidate source."""
        B, n, _ = x.shape
        vis = visible(pos, E, self.ratio)
        if self.index_topk is None:  # index_topk="all": every visible entry, no candidate filter
            picks = torch.where(vis, torch.arange(E, device=x.device), -1).expand(B, n, E)
            picks = self.hook_indexer_topk(picks)
            return picks_mask(picks, E) & vis
        idx = self.indexer
        qi = rope(idx.wq_b(qr).unflatten(-1, (idx.n_heads, idx.head_dim)), pos, self.inv_freq)
        if self.numerics.kv:
            qi = fp4_round_trip(qi, 32, "ue8m0")
        scores = idx.scores(x, qi, rt.index_keys[self.role.kv_source].to(x.device)).masked_fill(~vis, NEG_INF)
        allowed = vis.expand(B, n, E)
        if self.role.is_candidate_source:
            lens = vis.sum(-1)
            cand = select_candidate_blocks(scores, lens, self.cand_blocks, self.cand_size)
            rt.candidates = self.hook_candidates(cand)
        elif self.role.uses_candidates:
            assert rt.candidates is not None
            candidates = rt.candidates.to(x.device)
            scores = scores.masked_fill(~candidates, NEG_INF)
            allowed = allowed & candidates
            if bool((vis & ~candidates).any()):
                rt.candidate_binding.add(self.layer)
        if E and int(allowed.sum(-1).max()) > self.index_topk:
            rt.topk_binding.add(self.layer)
        picks = self.hook_indexer_topk(topk_picks(scores, self.index_topk))
        return picks_mask(picks, E) & vis

    def extra_repr(self) -> str:
        r = self.role
        return (f"layer={r.layer}, ratio={r.ratio}, kv_source={r.kv_source}, index_source={r.index_source}, "
                f"candidate_source={r.is_candidate_source}")

