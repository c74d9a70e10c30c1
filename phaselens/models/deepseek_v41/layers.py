"""Building blocks of the V4.1 text model: linear layers, RMSNorm, RoPE and hyper-connections.

The numerics themselves (RMSNorm, RoPE / YaRN frequencies, the FP8 round trip, packed weights) are the shared
ones of :mod:`phaselens.models.parts`; this module fits them to V4.1's modules and shapes.

Numerics follow DeepSeek's reference: RMSNorm, the hyper-connection mixes and the Sinkhorn projection run in
fp32 (``ct`` below: at least fp32) and are cast back; linear layers run in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from phaselens.models.deepseek_v41.kernels import CALLS, Kernels, kernel_linear, wants_kernel
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.formats import fp8_round_trip
from phaselens.models.parts.packed import PackedFormat, dequantize
from phaselens.models.parts.rope import apply_rope

Quantize = Literal["kv", "fp8"] | None


@dataclass
class Numerics:
    """Model-wide numeric options, shared by reference by every module of one model.

    ``quantize``: ``None`` (no round trips), ``"kv"`` (the reference's round trips on the window KV, the
    compressed KV and the indexer's queries and keys) or ``"fp8"`` (``"kv"`` plus FP8 activations into every
    GEMM whose weight the checkpoint stores in FP8 or FP4: the reference's full numerics).
    ``kernels``: how GEMMs on packed weights run (:mod:`~phaselens.models.deepseek_v41.kernels`).
    """

    quantize: Quantize = None
    kernels: Kernels = "auto"

    @property
    def kv(self) -> bool:
        return self.quantize in ("kv", "fp8")

    @property
    def activations(self) -> bool:
        return self.quantize == "fp8"


def packed_parameters(fmt: PackedFormat, lead: tuple[int, ...], rows: int, cols: int, scale_dtype: torch.dtype,
                      device: torch.device) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty ``(values, scales)`` of ``lead`` weights ``[rows, cols]`` packed in ``fmt`` (uint8 values, scales
    in ``scale_dtype``, no gradient), to be filled."""
    return tuple(nn.Parameter(torch.empty(*lead, *shape, dtype=dtype, device=device), requires_grad=False)
                 for shape, dtype in ((fmt.values_shape(rows, cols), torch.uint8),
                                      (fmt.scale_shape(rows, cols), scale_dtype)))


class Linear(nn.Module):
    """``y = x W^T`` in the model dtype. ``quantized`` marks layers whose GEMM the reference runs in FP8/FP4: it
    quantizes their input to FP8 (groups of 32), which ``Numerics(quantize="fp8")`` simulates.

    The weight is either dense (``weight`` ``[d_out, d_in]`` in ``dtype``) or packed as the checkpoint stores it
    (:meth:`set_packed`: ``weight`` holds the FP8/FP4 bytes and ``scale`` the block scales; see
    :mod:`~phaselens.models.parts.packed`), dequantized per call (or multiplied by transformers' kernel).
    ``stored`` is the release's format of this weight (``"fp8"`` or ``None``), for plans made without a checkpoint.
    """

    def __init__(self, d_in: int, d_out: int, numerics: Numerics, *, quantized: bool, dtype: torch.dtype,
                 stored: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in, dtype=dtype))
        self.register_parameter("scale", None)
        self.quantized, self.numerics, self.dtype, self.stored = quantized, numerics, dtype, stored
        self.fmt: PackedFormat | None = None
        self.shape = (d_out, d_in)

    def set_packed(self, fmt: PackedFormat, scale_dtype: torch.dtype = torch.uint8) -> None:
        """Hold the weight packed in ``fmt`` (empty tensors on the weight's device, to be filled)."""
        self.weight, self.scale = packed_parameters(fmt, (), *self.shape, scale_dtype, self.weight.device)
        self.fmt = fmt

    def dense_weight(self) -> Tensor:
        """The weight ``[d_out, d_in]`` in the model dtype (dequantized when packed)."""
        if self.fmt is None:
            return self.weight
        return dequantize(self.weight, self.scale, self.fmt, self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.weight.dtype if self.fmt is None else self.dtype)  # dense: follows model.to(dtype)
        fp8_in = self.quantized and self.numerics.activations
        if self.fmt is not None and wants_kernel(self.numerics.kernels, x, self.weight, fp8_in):
            y = kernel_linear(x, self.weight, self.scale, self.fmt)
            if y is not None:
                return y
        if fp8_in:
            x = fp8_round_trip(x, 32)
        if self.fmt is not None:
            CALLS["dequantize"] += 1
        return F.linear(x, self.dense_weight())

    def extra_repr(self) -> str:
        packed = f", packed={self.fmt.kind} {self.fmt.block[0]}x{self.fmt.block[1]}" if self.fmt else ""
        return f"d_in={self.shape[1]}, d_out={self.shape[0]}{packed}"


class GroupedLinear(Linear):
    """``wo_a``: block-diagonal over ``groups``, each group projecting its own ``d_in / groups`` inputs to
    ``rank`` outputs (weight ``[groups * rank, d_in / groups]``), applied as one einsum with no activation round
    trip (as the reference). A module call, so a device map's hooks see its weight."""

    def __init__(self, d_in: int, groups: int, rank: int, numerics: Numerics, *, dtype: torch.dtype,
                 stored: str | None = None) -> None:
        super().__init__(d_in // groups, groups * rank, numerics, quantized=False, dtype=dtype, stored=stored)
        self.groups, self.rank = groups, rank

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[B, n, groups * d_in/groups]`` -> ``[B, n, groups, rank]``."""
        w = self.dense_weight().view(self.groups, self.rank, -1)
        return torch.einsum("bngi,gri->bngr", x.unflatten(-1, (self.groups, -1)).to(w.dtype), w)


def rope(x: Tensor, positions: Tensor, inv_freq: Tensor, *, inverse: bool = False) -> Tensor:
    """Rotate the trailing ``2 * len(inv_freq)`` channels of ``x`` ``[B, n, (H,) d]`` at ``positions`` ``[n]``
    (adjacent channel pairs, as the reference's complex multiply)."""
    if x.dim() == 3:
        return apply_rope(x.unsqueeze(-2), positions, inv_freq, inverse=inverse).squeeze(-2)
    return apply_rope(x, positions, inv_freq, inverse=inverse)


# ---- hyper-connections -----------------------------------------------------------------------------
def hc_mixes(
    x: Float[Tensor, "batch pos hc d"], fn: Tensor, scale: Tensor, base: Tensor, *, iters: int, eps: float,
    norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(pre [B, n, hc], post [B, n, hc], comb [B, n, hc, hc])`` from one projection of the flattened streams.

    ``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``; ``comb`` is a row softmax (+ eps) made doubly
    stochastic by alternating column and row normalisation (``iters`` column steps in all).
    """
    hc = x.shape[2]
    ct = compute_dtype(x.dtype)
    flat = x.flatten(2).to(ct)
    mixes = F.linear(flat, fn.to(ct)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    scale, base = scale.to(ct), base.to(ct)
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn iterations (sequential by nature), each vectorised over tokens
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_pre(x: Float[Tensor, "batch pos hc d"], pre: Float[Tensor, "batch pos hc"]) -> Float[Tensor, "batch pos d"]:
    """Collapse the streams into one sublayer input, weighted by ``pre`` (in fp32, cast back)."""
    return torch.einsum("bnh,bnhd->bnd", pre, x.to(pre.dtype)).to(x.dtype)
