"""RMSNorm as DeepSeek-V4 computes it: in the compute dtype (at least fp32), cast back; the function and the
module every kind's norms are."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from phaselens.models.parts.dtypes import compute_dtype


def rms_norm(x: Float[Tensor, "*batch d"], weight: Float[Tensor, " d"], eps: float) -> Float[Tensor, "*batch d"]:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis in :func:`compute_dtype` of ``x``, returned in
    ``x.dtype``."""
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(ct) * xf).to(x.dtype)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned ``weight`` ``[d]`` (ones at init, in ``dtype``; ``None``: torch's default)."""

    def __init__(self, d: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, dtype=dtype))
        self.eps = eps

    def forward(self, x: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        return rms_norm(x, self.weight, self.eps)
