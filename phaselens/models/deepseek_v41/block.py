"""One DeepSeek-V4.1 layer (:class:`Block`): Engram's lookup where the layer has one, then hyper-connected
attention and MoE sublayers, with TransformerLens's residual hook points registered in execution order.

Hyper-connections as in V4.1's reference: a sublayer's ``pre`` (collapse) weights are used by the *next*
sublayer, so the block's attention collapses its input with the ``pre`` handed in, its FFN with the ``pre`` of its
own attention mix, and the block hands its FFN mix's ``pre`` on.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from phaselens.models.deepseek_v41.attention import V41Attention
from phaselens.models.deepseek_v41.cache import StackRuntime, V41Cache
from phaselens.models.deepseek_v41.config import LayerRole, V41Config
from phaselens.models.deepseek_v41.engram import Engram
from phaselens.models.deepseek_v41.engram_hash import EngramLayout
from phaselens.models.deepseek_v41.layers import Numerics, hc_mixes, hc_pre
from phaselens.models.deepseek_v41.moe import MoE
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.norms import RMSNorm
from phaselens.models.parts.numerics_deepseek import mix_streams
from phaselens.models.parts.tl_factored import FactoredBlockNames


class Block(FactoredBlockNames, nn.Module):
    """One layer: hyper-connected attention and MoE sublayers (checkpoint names ``hc_attn_fn``, ...)."""

    def __init__(self, cfg: V41Config, role: LayerRole, numerics: Numerics, dtype: torch.dtype,
                 index_topk: int | None, engram: EngramLayout | None = None) -> None:
        super().__init__()
        if engram is not None and role.layer in engram.layer_ids:
            self.engram = Engram(cfg, engram.layer_ids.index(role.layer), numerics, dtype, engram.n_cols)
        hc, D = cfg.hc_mult, cfg.hidden_size
        ct = compute_dtype(dtype)
        mix = (2 + hc) * hc
        self.hook_resid_pre = HookPoint()  # hook points in execution order (nnsight reads them in that order)
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.attn = V41Attention(cfg, role, numerics, dtype, index_topk=index_topk)
        self.hook_attn_out, self.hook_resid_mid = HookPoint(), HookPoint()
        self.ffn = MoE(cfg, numerics, dtype)
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.empty(mix, hc * D, dtype=ct)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.empty(mix, dtype=ct)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.empty(3, dtype=ct)))
        self.hc_kw = dict(iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, pre: Tensor, start: int, cache: V41Cache, rt: StackRuntime,
                rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x`` ``[B, n, hc, D]``, ``pre`` ``[B, n, hc]`` -> (new streams, the ``pre`` for the next block).

        ``rows`` ``[B, n, n_engram_layers, cols]``: the Engram table rows of the call (Engram layers only).
        """
        if hasattr(self, "engram"):
            x = self.engram(x, rows[:, :, self.engram.index])
        x = self.hook_resid_pre(x)
        a_pre, a_post, a_comb = hc_mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, **self.hc_kw)
        out = self.hook_attn_out(self.attn(self.attn_norm(hc_pre(x, pre)), start, cache, rt))
        x = self.hook_resid_mid(mix_streams(out, x, a_post, a_comb))
        f_pre, f_post, f_comb = hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, **self.hc_kw)
        out = self.hook_mlp_out(self.ffn(self.ffn_norm(hc_pre(x, a_pre))))
        return self.hook_resid_post(mix_streams(out, x, f_post, f_comb)), f_pre

__all__ = ["Block"]
