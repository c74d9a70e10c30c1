"""Independent, loop-based references for the model's arithmetic (slow, tiny sizes only)."""

from __future__ import annotations

import math

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from phaselens.models.compressed.transformer import CompressedTransformer


def hf_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """transformers' DeepSeek-V4 interleaved trailing-slice RoPE, on ``[B, T, H, d]``."""
    freqs = pos[None, :, None].float() * inv_freq
    cos, sin = freqs.cos(), sign * freqs.sin()
    return hf.apply_rotary_pos_emb(x.transpose(1, 2), cos, sin).transpose(1, 2)


class _SinkModule(torch.nn.Module):
    def __init__(self, sinks: torch.Tensor, groups: int) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = groups


def full_attention_reference(model: CompressedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a full-attention model via transformers' eager sink attention (causal mask)."""
    cfg = model.config
    B, T = tokens.shape
    H, Hkv, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    pos = torch.arange(T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

    resid = model.embed.weight[tokens]
    for block in model.blocks:
        a = block.attn
        h = rms(resid, block.ln1.weight)
        q = (h @ a.flat("W_Q")).view(B, T, H, d)
        k, v = (h @ a.flat("W_K")).view(B, T, Hkv, d), (h @ a.flat("W_V")).view(B, T, Hkv, d)
        if a.inv_freq.numel():
            q, k = hf_rope(q, pos, a.inv_freq), hf_rope(k, pos, a.inv_freq)
        sinks = a.sink if a.sink is not None else torch.full((H,), -1e30)
        z, _ = hf.eager_attention_forward(
            _SinkModule(sinks, H // Hkv), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
            scaling=1 / math.sqrt(d),
        )
        resid = resid + z.reshape(B, T, H * d) @ a.flat("W_O")
        h = rms(resid, block.ln2.weight)
        m = block.mlp
        resid = resid + torch.nn.functional.gelu(h @ m.W_in + m.b_in) @ m.W_out + m.b_out
    return rms(resid, model.ln_final.weight) @ model.unembed.weight.T


def brute_entries(attn, h: torch.Tensor, path: str) -> torch.Tensor:
    """Entries ``[B, T//S, Hkv, d]`` of one path by explicit loops over entries and slots."""
    comp = attn.compressor
    spec = comp.spec
    pooler = comp.poolers[path]
    S, W = spec.stride, spec.window
    B, T, _ = h.shape
    Hkv, d = attn.cfg.n_key_value_heads, attn.cfg.d_head
    out = torch.zeros(B, T // S, Hkv, d)
    for j in range(T // S):
        logits, payloads = [], []
        for i in range(W):
            t = j * S + S - W + i
            if t < 0:
                continue
            g, p = divmod(i, S)
            wp = pooler.payload.weight
            payloads.append(h[:, t] @ wp[g % wp.shape[0], p % wp.shape[1]])
            if pooler.gate is None:
                logits.append(torch.zeros(B, Hkv))
            else:
                wg = pooler.gate.weight
                s = h[:, t] @ wg[g % wg.shape[0], p % wg.shape[1]]
                if pooler.position_bias is not None:
                    s = s + pooler.position_bias[g, p]
                logits.append(s)
        lg = torch.stack(logits, 1)  # [B, slots, C]
        alpha = lg.softmax(1)
        pay = torch.stack(payloads, 1).view(B, -1, Hkv, d)
        if alpha.shape[-1] == Hkv:
            alpha = alpha.unsqueeze(-1)
        else:
            alpha = alpha.view(B, -1, Hkv, d)
        row = (alpha * pay).sum(1)
        if comp.norm_weight is not None:
            row = comp.norm_weight[path] * row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
        if comp.rotated(path):
            row = hf_rope(row[:, None], torch.tensor([j * S]), comp.inv_freq)[:, 0]
        out[:, j] = row
    return out


def brute_compressed_z(attn, h: torch.Tensor) -> torch.Tensor:
    """Per-head attention output ``[B, T, H, d]`` of a compressed layer, one query at a time."""
    cfg = attn.cfg
    B, T, _ = h.shape
    H, Hkv, d, L = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.local_window
    S = attn.compressor.stride
    pos = torch.arange(T)
    q = (h @ attn.flat("W_Q")).view(B, T, H, d)
    if attn.tied:
        k = v = (h @ attn.flat("W_KV")).view(B, T, Hkv, d)
    else:
        k, v = (h @ attn.flat("W_K")).view(B, T, Hkv, d), (h @ attn.flat("W_V")).view(B, T, Hkv, d)
    if attn.inv_freq.numel():
        q = hf_rope(q, pos, attn.inv_freq)
        k = hf_rope(k, pos, attn.inv_freq)
        if attn.tied:
            v = k
    ents = {p: brute_entries(attn, h, p) for p in attn.compressor.paths}
    ek, ev = (ents["kv"], ents["kv"]) if attn.tied else (ents["k"], ents["v"])
    z = torch.zeros(B, T, H, d)
    for t in range(T):
        keys = list(range(max(0, t - L + 1), t + 1))
        n_vis = (t + 1) // S
        for head in range(H):
            kv = head // (H // Hkv)
            logits = [torch.einsum("bd,bd->b", q[:, t, head], k[:, s, kv]) for s in keys]
            logits += [torch.einsum("bd,bd->b", q[:, t, head], ek[:, j, kv]) for j in range(n_vis)]
            lg = torch.stack(logits, -1) / math.sqrt(d)
            if attn.sink is not None:
                lg = torch.cat([lg, attn.sink[head].expand(B, 1)], -1)
            p = lg.softmax(-1)
            vals = [v[:, s, kv] for s in keys] + [ev[:, j, kv] for j in range(n_vis)]
            z[:, t, head] = sum(p[:, i, None] * vals[i] for i in range(len(vals)))
    if attn.tied and attn.inv_freq.numel():
        z = hf_rope(z, pos, attn.inv_freq, sign=-1.0)
    return z
