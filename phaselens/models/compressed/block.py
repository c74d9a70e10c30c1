"""One block of :class:`~phaselens.models.compressed.transformer.CompressedTransformer`: pre-norm attention and
MLP sublayers with TransformerLens's hook points (``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_mid``,
``hook_mlp_out``, ``hook_resid_post``; the MLP's ``hook_pre`` / ``hook_pre_linear`` / ``hook_post``), registered
in execution order so nnsight can read them in any order it visits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from phaselens.models.compressed.attention import Attention, Past
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.parts.norms import RMSNorm


class MLP(nn.Module):
    """``cfg.mlp="gelu"``: ``W_out gelu(W_in x + b_in) + b_out``; ``"swiglu"`` (Qwen3, TransformerLens's gated
    MLP names): ``W_out (silu(W_gate x) * (W_in x))``. Biases only with ``cfg.mlp_bias``.

    Hooks ``[batch, pos, d_mlp]``: ``hook_pre`` (the activation's input: ``W_in x`` for gelu, ``W_gate x`` for
    swiglu), ``hook_pre_linear`` (swiglu: ``W_in x``), ``hook_post`` (what ``W_out`` reads).
    """

    def __init__(self, cfg: CompressedConfig) -> None:
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.mlp_bias else None
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.mlp_bias else None
        self.hook_pre = HookPoint()
        if self.gated:
            self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()

    @staticmethod
    def _bias(x: Tensor, b: Tensor | None) -> Tensor:
        return x if b is None else x + b

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            gate = self.hook_pre(x @ self.W_gate)
            up = self.hook_pre_linear(self._bias(x @ self.W_in, self.b_in))
            post = self.hook_post(F.silu(gate) * up)
        else:
            post = self.hook_post(F.gelu(self.hook_pre(self._bias(x @ self.W_in, self.b_in))))
        return self._bias(post @ self.W_out, self.b_out)


class Block(nn.Module):
    """Pre-norm residual block. Residual hooks are ``[batch, pos, d_model]``."""

    hook_out_is_single_residual_stream = True  # one residual stream (TransformerLens's logit lens reads it)

    def __init__(self, cfg: CompressedConfig, layer: int) -> None:
        super().__init__()
        self.hook_resid_pre = HookPoint()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.hook_attn_out, self.hook_resid_mid = HookPoint(), HookPoint()
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()

    def forward(self, resid: Tensor, past: Past) -> Tensor:
        resid = self.hook_resid_pre(resid)
        resid = self.hook_resid_mid(resid + self.hook_attn_out(self.attn(self.ln1(resid), past)))
        return self.hook_resid_post(resid + self.hook_mlp_out(self.mlp(self.ln2(resid))))
