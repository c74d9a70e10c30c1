"""Attention of one layer: full causal, sliding (local) only, or local window + compressed entries + sink.

A compressed layer scores each query against three kinds of keys in **one** softmax::

    [ the last `local_window` raw tokens ]  U  [ complete compressed entries ]  U  [ sink ]

Memory is O(T * (local_window + T / S)) per head: there is never a T x T score matrix in a compressed
layer. Past state (a KV cache, or nothing for a parallel forward) comes through a :class:`Past` object, so
the parallel forward, chunked prefill and single-token decoding share every line of arithmetic.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from phaselens.models.compressed.compressor import Compressor, PoolerState
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.hooking import read_only
from phaselens.models.parts.norms import rms_norm
from phaselens.models.parts.rope import apply_rope
from phaselens.models.parts.tl_weights import TLFlatAttention

LayerKind = Literal["compressed", "local", "full"]


@runtime_checkable
class Past(Protocol):
    """What one layer knows about earlier tokens. ``start`` is the slot of the first new token."""

    start: int

    def raw_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Raw keys/values ``[B, P + n, Hkv, d]`` ending with the new ``n`` rows, in slot order.

        Full layers get every earlier row (P = start); local ones at most ``local_window - 1``.
        """
        ...

    def entries(self, path: str, new: Tensor) -> Tensor:
        """All entries ``[B, E, Hkv, d]`` of ``path``: the earlier ones followed by ``new``."""
        ...

    def pooler_state(self, path: str) -> PoolerState | None: ...

    def set_pooler_state(self, path: str, state: PoolerState) -> None: ...


class NoPast:
    """The empty past of a parallel forward from slot 0."""

    start = 0

    def raw_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v

    def entries(self, path: str, new: Tensor) -> Tensor:
        return new

    def pooler_state(self, path: str) -> PoolerState | None:
        return None

    def set_pooler_state(self, path: str, state: PoolerState) -> None:
        pass


class Attention(TLFlatAttention, nn.Module):
    """Multi-head attention with GQA, RoPE on trailing channels, an optional sink, and compressed entries.

    Heads are KV-major: query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.

    Hook points (shapes; ``n`` = new positions):
        ``hook_q`` [B, n, H, d] (before RoPE; after the QK-norm when ``cfg.qk_norm``), ``hook_k`` / ``hook_v``
        [B, n, Hkv, d] (``hook_kv`` when K = V; keys after the QK-norm too),
        ``hook_z`` [B, n, H, d]; full layers: ``hook_pattern`` [B, H, n, keys];
        local and compressed layers: ``hook_pattern_local`` [B, H, n, local_window] (index i is key slot
        q - local_window + 1 + i), ``hook_pattern_sink`` [B, H, n];
        compressed layers: ``hook_pattern_entry`` [B, H, n, entries], ``hook_gate_k`` / ``hook_gate_v``
        (``hook_gate`` when K = V) [B, new_entries, W, Hkv] or [B, new_entries, W, Hkv, d] for vector gates,
        ``hook_entry_k`` / ``hook_entry_v`` (``hook_entry`` when K = V) [B, new_entries, Hkv, d].
    """

    def __init__(self, cfg: CompressedConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        H, Hkv, d, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
        if cfg.layer_is_compressed(layer):
            self.kind: LayerKind = "compressed"
        else:
            self.kind = "local" if cfg.compression is not None and cfg.uncompressed_attention == "local" else "full"
        self.tied = self.kind == "compressed" and cfg.compression is not None and cfg.compression.tied_kv
        self.scale = 1.0 / math.sqrt(d)
        self.W_Q = nn.Parameter(torch.empty(D, H * d))
        if self.tied:
            self.W_KV = nn.Parameter(torch.empty(D, Hkv * d))
        else:
            self.W_K = nn.Parameter(torch.empty(D, Hkv * d))
            self.W_V = nn.Parameter(torch.empty(D, Hkv * d))
        self.W_O = nn.Parameter(torch.empty(H * d, D))
        self.sink = nn.Parameter(torch.zeros(H)) if cfg.sink else None
        # QK-norm (Qwen3): one RMSNorm gain per channel, shared by the heads, on queries and raw keys
        self.q_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.rope_style = cfg.rope.style if cfg.rope is not None else "interleaved"
        inv_freq = torch.zeros(0) if cfg.rope is None else cfg.rope.inv_freq(d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.compressor: Compressor | None = None
        if self.kind == "compressed":
            assert cfg.compression is not None
            self.compressor = Compressor(cfg.compression, D, Hkv, d, cfg.rope)

        # hook points in execution order (nnsight reads them in that order): q, k/v, the compressor's gates and
        # entries, the pattern parts, z
        self.hook_q = HookPoint()
        if self.tied:
            self.hook_kv = HookPoint()
        else:
            self.hook_k, self.hook_v = HookPoint(), HookPoint()
        if self.kind == "compressed":
            if self.tied:
                self.hook_gate, self.hook_entry = HookPoint(), HookPoint()
            else:
                self.hook_gate_k, self.hook_entry_k = HookPoint(), HookPoint()
                self.hook_gate_v, self.hook_entry_v = HookPoint(), HookPoint()
        if self.kind == "full":
            self.hook_pattern = HookPoint()
        else:
            self.hook_pattern_local = HookPoint()
            if self.kind == "compressed":
                self.hook_pattern_entry = HookPoint()
            self.hook_pattern_sink = HookPoint()
        self.hook_z = HookPoint()

    # ---- helpers -------------------------------------------------------------------------------------
    @property
    def phase_spec(self):
        return self.compressor.spec.phase_spec if self.compressor is not None else None

    def _rope(self, x: Tensor, pos: Tensor, inverse: bool = False) -> Tensor:
        return apply_rope(x, pos, self.inv_freq, inverse=inverse, style=self.rope_style)

    def _norm(self, x: Tensor, weight: Tensor | None) -> Tensor:
        return x if weight is None else rms_norm(x, weight, self.cfg.norm_eps)

    def _path_hook(self, name: str, path: str) -> HookPoint:
        """``hook_{name}`` of the tied K = V path ``"kv"``, else ``hook_{name}_{path}``."""
        return getattr(self, f"hook_{name}" if path == "kv" else f"hook_{name}_{path}")

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, x: Float[Tensor, "batch pos d_model"], past: Past) -> Float[Tensor, "batch pos d_model"]:
        cfg = self.cfg
        B, n, _ = x.shape
        H, Hkv, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
        G = H // Hkv
        pos = past.start + torch.arange(n, device=x.device)
        q = self._rope(self.hook_q(self._norm((x @ self.flat("W_Q")).view(B, n, H, d), self.q_norm)), pos)
        if self.tied:
            k_pre = v = self.hook_kv(self._norm((x @ self.flat("W_KV")).view(B, n, Hkv, d), self.k_norm))
            k = v = self._rope(k_pre, pos)
            own = {"kv": k_pre}
        else:
            k_pre = self.hook_k(self._norm((x @ self.flat("W_K")).view(B, n, Hkv, d), self.k_norm))
            k = self._rope(k_pre, pos)
            v = self.hook_v((x @ self.flat("W_V")).view(B, n, Hkv, d))
            own = {"k": k_pre, "v": v}
        keys, values = past.raw_context(k, v)
        qg = q.view(B, n, Hkv, G, d)

        if self.kind == "full":
            z = self._full(qg, keys, values, pos)
        else:
            z = self._local_entries(x, qg, keys, values, pos, past, own)
        if self.tied and self.inv_freq.numel():
            z = self._rope(z, pos, inverse=True)  # K = V carried RoPE into the values; undo it at the query
        z = self.hook_z(z)
        return z.reshape(B, n, H * d) @ self.flat("W_O")

    def _softmax(self, parts: list[Tensor], B: int, n: int) -> list[Tensor]:
        sink = None if self.sink is None else self.sink.view(1, -1, 1, 1).expand(B, -1, n, 1)
        logits = torch.cat(parts + ([sink] if sink is not None else []), dim=-1)
        probs = logits.to(compute_dtype(logits.dtype)).softmax(dim=-1).to(logits.dtype)
        sizes = [p.shape[-1] for p in parts] + ([1] if sink is not None else [])
        return list(probs.split(sizes, dim=-1))

    def _full(self, qg: Tensor, keys: Tensor, values: Tensor, pos: Tensor) -> Tensor:
        B, n, Hkv, G, d = qg.shape
        P = keys.shape[1]
        key_pos = pos[-1] - P + 1 + torch.arange(P, device=qg.device)
        scores = torch.einsum("bnkgd,bpkd->bkgnp", qg, keys).reshape(B, Hkv * G, n, P) * self.scale
        scores = scores.masked_fill(key_pos[None, None, None, :] > pos[None, None, :, None], float("-inf"))
        pattern = self.hook_pattern(self._softmax([scores], B, n)[0])
        z = torch.einsum("bkgnp,bpkd->bnkgd", pattern.view(B, Hkv, G, n, P), values)
        return z.reshape(B, n, Hkv * G, d)

    def _local_entries(
        self, x: Tensor, qg: Tensor, keys: Tensor, values: Tensor, pos: Tensor, past: Past,
        own: dict[str, Tensor],
    ) -> Tensor:
        B, n, Hkv, G, d = qg.shape
        H, L = Hkv * G, self.cfg.local_window
        # Left-pad so that row r of the unfolded window holds key slots pos_r - L + 1 .. pos_r.
        pad = L - 1 - (keys.shape[1] - n)
        k_win = torch.nn.functional.pad(keys, (0, 0, 0, 0, pad, 0)).unfold(1, L, 1)  # [B, n, Hkv, d, L]
        v_win = torch.nn.functional.pad(values, (0, 0, 0, 0, pad, 0)).unfold(1, L, 1)
        # Broadcast-multiply-sum rather than einsum: einsum would run B*n*Hkv tiny matmuls.
        local = (qg.unsqueeze(-1) * k_win.unsqueeze(3)).sum(-2)  # [B, n, Hkv, G, L]
        local = local.permute(0, 2, 3, 1, 4).reshape(B, H, n, L) * self.scale
        key_pos = pos[:, None] - L + 1 + torch.arange(L, device=x.device)  # [n, L]
        local = local.masked_fill((key_pos < 0)[None, None], float("-inf"))
        parts = [local]
        entry_v = None
        if self.compressor is not None:
            entry_k, entry_v = self._entries(x, past, own)
            E = entry_k.shape[1]
            # Head-major matmuls: with the cache's head-major storage these read the entries in place.
            q_heads = qg.permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * n, d)
            ent = torch.matmul(q_heads, entry_k.transpose(1, 2).transpose(-1, -2))  # [B, Hkv, G*n, E]
            ent = ent.view(B, H, n, E) * self.scale
            visible = (pos + 1) // self.compressor.stride  # entries 0..visible-1 are complete
            ent = ent.masked_fill(torch.arange(E, device=x.device)[None, :] >= visible[:, None], float("-inf"))
            parts.append(ent)
        probs = self._softmax(parts, B, n)
        p_local = self.hook_pattern_local(probs[0])
        p_l = p_local.view(B, Hkv, G, n, L).permute(0, 3, 1, 2, 4)  # [B, n, Hkv, G, L]
        z = (p_l.unsqueeze(-2) * v_win.unsqueeze(3)).sum(-1)  # [B, n, Hkv, G, d]
        if entry_v is not None:
            p_entry = self.hook_pattern_entry(probs[1])
            z_ent = torch.matmul(p_entry.reshape(B, Hkv, G * n, -1), entry_v.transpose(1, 2))  # [B, Hkv, G*n, d]
            z = z + z_ent.view(B, Hkv, G, n, d).permute(0, 3, 1, 2, 4)
        sink = probs[-1].squeeze(-1) if self.sink is not None else probs[0].new_zeros(B, H, n)
        read_only(self.hook_pattern_sink, sink)
        return z.reshape(B, n, H, d)

    def _entries(self, x: Tensor, past: Past, own: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Pool the entries that complete among the new tokens; return all entries (keys, values).

        ``own``: this layer's keys (QK-normed, before RoPE) and values of the new tokens ``[B, n, Hkv, d]``,
        the payload of a ``payload="attention"`` compressor."""
        assert self.compressor is not None
        out = {}
        for path in self.compressor.paths:
            pooler = self.compressor.poolers[path]
            alpha, windows, state, first = pooler.gates(x, past.start, past.pooler_state(path),
                                                        own[path].flatten(-2))
            alpha = self._path_hook("gate", path)(alpha)
            rows = self.compressor.finish(path, pooler.pool(alpha, windows), first)
            rows = self._path_hook("entry", path)(rows)
            past.set_pooler_state(path, state)
            out[path] = past.entries(path, rows)
        if self.tied:
            return out["kv"], out["kv"]
        return out["k"], out["v"]
