"""The quantization steps of DeepSeek's V4 inference, as plain tensor functions.

DeepSeek's ``inference/model.py`` calls "fused quant + dequant" steps on some activations, to match what the
model saw in quantization-aware training:

* **FP8** (``e4m3``, largest finite value 448) on the non-RoPE dims of the window KV of every layer and of the
  compressed entries, in blocks of 64 channels. As the published ``kernel.py`` is written this step does not
  round: with ``inplace=True`` its ``act_quant`` casts ``x / s`` to its output dtype, which is then the
  input's (bf16), and back, so a bf16 input comes out unchanged. :func:`fp8_simulate` rounds through e4m3
  instead, as an FP8 KV cache (or an FP8 attention kernel reading one) does: ``quantize="fp8"``.
* a **Hadamard rotation** (Sylvester order, scaled by ``n**-0.5``) then **FP4** (``e2m1``, largest value 6) on
  the indexer's queries and compressed keys, in blocks of 32 channels; the published ``fp4_act_quant`` does
  round through FP4 (``quantize="published"`` and ``"fp8"`` both do this).

Every block gets one power-of-two scale (the ``ue8m0`` scale format): ``s = 2**ceil(log2(amax * (1/qmax)))``
with ``amax`` the block's largest magnitude (at least ``1e-4`` for FP8, ``6 * 2**-126`` for FP4), computed in
fp32 as the reference's kernels do. Each value becomes ``round(clamp(x / s, -qmax, qmax)) * s``, rounded to
nearest with ties to even on the format's grid (e4m3 or e2m1), then cast back to the input dtype. Because ``s`` is a power
of two, ``x / s`` and the product are exact; only the rounding to the grid loses information.

These functions do the arithmetic only; :mod:`.numerics` places them in a transformers model.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.core.errors import InputError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest float4_e2m1
FP8_BLOCK = 64  # channels per scale: window KV and compressed entries (non-RoPE dims)
FP4_BLOCK = 32  # channels per scale: indexer q and k
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126


def pow2_scale(amax: Tensor, qmax: float) -> Tensor:
    """``2**ceil(log2(amax * fp32(1/qmax)))`` in fp32, exactly (from the float's exponent and mantissa, as the
    reference's kernels read them), for positive normal ``amax``."""
    v = amax.float() * torch.tensor(1.0 / qmax, dtype=torch.float32, device=amax.device)
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two keeps its exponent
    return torch.ldexp(torch.ones_like(v), exponent)


def _blocks(x: Tensor, block: int, what: str) -> Tensor:
    n = x.shape[-1]
    if n % block:
        raise InputError(
            f"{what} quantizes blocks of {block} channels, but the last dimension is {n}; DeepSeek-V4's "
            f"reference needs a multiple of {block} (the released models have it)."
        )
    return x.float().reshape(*x.shape[:-1], n // block, block)


def fp8_simulate(x: Float[Tensor, "... n"], block: int = FP8_BLOCK) -> Float[Tensor, "... n"]:
    """Round ``x`` through block-scaled FP8 (e4m3) and back, in ``x``'s dtype and shape."""
    b = _blocks(x, block, "FP8 simulation")
    amax = b.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_scale(amax, FP8_MAX)
    q = (b / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # round to nearest, ties to even
    return (q * s).reshape(x.shape).to(x.dtype)


def round_e2m1(v: Tensor) -> Tensor:
    """Round fp32 values in ``[-6, 6]`` to the nearest FP4 (e2m1) value, ties to even.

    The e2m1 grid is 0, 0.5, 1, 1.5 (step 0.5), 2, 3 (step 1), 4, 6 (step 2); within each step the even
    multiples carry an even mantissa, so ``torch.round`` (half to even) on ``v / step`` is the format's rounding.
    """
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_simulate(x: Float[Tensor, "... n"], block: int = FP4_BLOCK) -> Float[Tensor, "... n"]:
    """Round ``x`` through block-scaled FP4 (e2m1) and back, in ``x``'s dtype and shape."""
    b = _blocks(x, block, "FP4 simulation")
    amax = b.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    s = pow2_scale(amax, FP4_MAX)
    q = round_e2m1((b / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).reshape(x.shape).to(x.dtype)


@lru_cache(maxsize=8)
def _sylvester(n: int, device: torch.device) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    for _ in range(int(math.log2(n))):  # log2(n) doublings, not a loop over data
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(x: Float[Tensor, "... n"]) -> Float[Tensor, "... n"]:
    """``x @ H_n / sqrt(n)`` with ``H_n`` the Sylvester-ordered Hadamard matrix, in fp32, cast back to
    ``x``'s dtype. Orthogonal, so it leaves inner products between rotated vectors unchanged."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise InputError(f"the Hadamard rotation needs a power-of-two dimension, got {n}.")
    h = _sylvester(n, x.device)
    return ((x.float() @ h) * n**-0.5).to(x.dtype)


def indexer_simulate(x: Float[Tensor, "... n"]) -> Float[Tensor, "... n"]:
    """What the reference does to the indexer's queries and keys after RoPE: rotate, then FP4."""
    return fp4_simulate(hadamard(x))
