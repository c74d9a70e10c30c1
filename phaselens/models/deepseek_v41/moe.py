"""The V4.1 feed-forward: a mixture of routed SwiGLU experts plus one shared expert.

Routing (reference ``Gate``): fp32 scores ``act(x W^T / gate_temp)`` (``sqrtsoftplus`` in V4.1); the
correction ``bias`` only chooses the top-k experts; their weights are the unbiased scores, normalised to sum
to one (``norm_topk_prob``, +1e-20) and multiplied by ``routed_scaling_factor``. Every expert (the shared one
too, unlike V4) clamps its up branch to ``+-swiglu_limit`` and its gate branch from above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phaselens.models.deepseek_v41.config import V41Config
from phaselens.models.deepseek_v41.layers import Linear, Numerics, compute_dtype
from phaselens.models.deepseek_v41.quant import fp8_round_trip


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """``silu(gate) * up`` in fp32 with the reference's clamps (no clamp when ``limit <= 0``)."""
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    def __init__(self, d_model: int, d_ff: int, numerics: Numerics, dtype: torch.dtype, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, numerics, quantized=True, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, numerics, quantized=True, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, numerics, quantized=True, dtype=dtype)
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        ct = compute_dtype(x.dtype)
        h = swiglu(self.w1(x).to(ct), self.w3(x).to(ct), self.limit)
        return self.w2(h.to(x.dtype))


class RoutedExperts(nn.Module):
    """The routed experts' weights stacked per layer: ``w1``, ``w3`` ``[E, d_ff, D]`` and ``w2`` ``[E, D, d_ff]``
    (checkpoint ``ffn.experts.{e}.w{1,2,3}.weight``, FP4 there)."""

    def __init__(self, n: int, d_model: int, d_ff: int, numerics: Numerics, dtype: torch.dtype, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, d_ff, d_model, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(n, d_model, d_ff, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(n, d_ff, d_model, dtype=dtype))
        self.numerics, self.limit = numerics, limit

    def _in(self, x: Tensor) -> Tensor:
        return fp8_round_trip(x, 32) if self.numerics.activations else x

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``x`` ``[N, D]``, ``indices`` / ``weights`` ``[N, k]`` -> fp32 ``[N, D]``.

        One loop over the experts that received tokens (each step one batched GEMM over its tokens), as the
        reference does: a dense gather of ``[N, k, d_ff, D]`` expert weights would not fit at real scale.
        """
        ct = compute_dtype(x.dtype)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=ct, device=x.device)
        for e in torch.unique(indices).tolist():
            rows, slot = torch.where(indices == e)
            xe = self._in(x[rows])
            h = swiglu(F.linear(xe, self.w1[e]).to(ct), F.linear(xe, self.w3[e]).to(ct), self.limit)
            h = (weights[rows, slot, None] * h).to(x.dtype)
            y.index_add_(0, rows, F.linear(self._in(h), self.w2[e]).to(ct))
        return y


class Gate(nn.Module):
    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=compute_dtype(dtype)))
        self.topk, self.func, self.temp = cfg.num_experts_per_tok, cfg.scoring_func, cfg.gate_temp
        self.norm, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``[N, D]`` -> ``(weights [N, k] fp32, indices [N, k])``."""
        ct = compute_dtype(x.dtype)
        s = F.linear(x.to(ct), self.weight.to(ct)) / self.temp
        if self.func == "softmax":
            s = s.softmax(-1)
        elif self.func == "sigmoid":
            s = s.sigmoid()
        else:
            s = F.softplus(s).sqrt()
        indices = (s + self.bias.to(ct)).topk(self.topk, dim=-1).indices
        w = s.gather(1, indices)
        if self.norm and self.topk > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, indices


class MoE(nn.Module):
    """``ffn``: ``gate``, ``experts`` (stacked) and ``shared_experts`` (checkpoint names)."""

    def __init__(self, cfg: V41Config, numerics: Numerics, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.n_shared_experts != 1:
            from phaselens.core.errors import UnsupportedModelError

            raise UnsupportedModelError(f"n_shared_experts={cfg.n_shared_experts}; the V4.1 reference has exactly 1.")
        D, F_ = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, dtype)
        self.experts = RoutedExperts(cfg.n_routed_experts, D, F_, numerics, dtype, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(D, F_, numerics, dtype, cfg.swiglu_limit)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        y = self.experts(flat, indices, weights)
        y = y + self.shared_experts(flat).to(y.dtype)
        return y.to(x.dtype).view(shape)
