"""DeepSeek-V4.1's number formats: dequantizing checkpoint weights, and simulating the reference's
quantize-dequantize round trips.

Checkpoint formats (reference ``inference/model.py`` / ``convert.py``, revision dba1be0a):

* FP8 weights: ``float8_e4m3fn`` values with one power-of-two (UE8M0) scale per ``32 x 32`` block;
  ``w = q * scale[i // 32, j // 32]``.
* FP4 routed experts: two E2M1 codes per byte along the input axis, the *first* element in the low nibble,
  one UE8M0 scale per row and 32 inputs; ``w = E2M1[code] * scale[i, j // 32]``.

Round trips the reference applies during the forward (all in fp32, the result cast back):

* :func:`fp8_round_trip` (``act_quant``): groups of 32 along the last axis, ``amax`` floored at 1e-4, scale
  ``2^ceil(log2(amax / 448))``, values clamped to +-448 and rounded to E4M3. Used on the window KV and, with
  ``quantize="fp8"``, on the input of every FP8/FP4-weight GEMM.
* :func:`fp4_round_trip` (``fp4_act_quant``): E2M1 with round-half-to-even, clamped to +-6. ``scale="ue8m0"``
  (groups of 32, the indexer's queries and keys): ``amax`` floored at ``6 * 2^-126``, scale
  ``2^ceil(log2(amax / 6))``. ``scale="e4m3"`` (groups of 16, the compressed KV): ``amax`` floored at
  ``6 * 2^-9``, scale ``amax / 6`` rounded to E4M3 (not a power of two).

Every function is vectorised over all leading axes.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from phaselens.core.errors import CheckpointError

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_MAX = 448.0
_FP4_MAX = 6.0
# midpoints between neighbouring E2M1 magnitudes, and whether a tie there rounds up (to the even code)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


# ---- decoding the checkpoint ---------------------------------------------------------------------
def e2m1_decode(codes: Tensor) -> Tensor:
    """fp32 values of 4-bit E2M1 codes (bit 3 is the sign)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def unpack_fp4(packed: Tensor) -> Tensor:
    """``[..., K/2]`` packed bytes (any 8-bit dtype, or ``float4_e2m1fn_x2``) -> ``[..., K]`` fp32, low nibble
    first."""
    if packed.element_size() != 1:
        raise CheckpointError(f"FP4 weights must be packed bytes, got dtype {packed.dtype}.")
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((e2m1_decode(b & 0x0F), e2m1_decode(b >> 4)), dim=-1).flatten(-2)


def dequant_fp8_blocks(weight: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """FP8 ``[O, I]`` with block scales ``[ceil(O/bo), ceil(I/bi)]`` -> fp32 ``[O, I]``."""
    n_out, n_in = weight.shape
    bo, bi = block
    want = (-(-n_out // bo), -(-n_in // bi))
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"an FP8 weight {tuple(weight.shape)} with {bo}x{bi} blocks needs a scale of shape {want}, "
            f"got {tuple(scale.shape)}."
        )
    s = scale.float().repeat_interleave(bo, 0)[:n_out].repeat_interleave(bi, 1)[:, :n_in]
    return weight.float() * s


def dequant_fp4_rows(packed: Tensor, scale: Tensor, group: int = 32) -> Tensor:
    """Packed FP4 ``[O, I/2]`` with per-row group scales ``[O, I/group]`` -> fp32 ``[O, I]``."""
    values = unpack_fp4(packed)
    n_out, n_in = values.shape
    if tuple(scale.shape) != (n_out, n_in // group) or n_in % group:
        raise CheckpointError(
            f"an FP4 weight of logical shape {(n_out, n_in)} needs a scale of shape {(n_out, n_in // group)} "
            f"(one per {group} inputs), got {tuple(scale.shape)}."
        )
    return values * scale.float().repeat_interleave(group, 1)


# ---- round trips ---------------------------------------------------------------------------------
def _ceil_pow2(x: Tensor) -> Tensor:
    """``2^ceil(log2(x))`` for positive fp32 ``x``, exactly (no log/exp rounding)."""
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), e - (m == 0.5).to(e.dtype))


def _groups(x: Tensor, size: int) -> Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"last axis {x.shape[-1]} is not a multiple of the quantization group {size}")
    return x.float().unflatten(-1, (-1, size))


def e2m1_round(v: Tensor) -> Tensor:
    """Round fp32 ``v`` (already within +-6) to the nearest E2M1 value, ties to the even code."""
    a = v.abs()
    bounds = torch.tensor(_MIDPOINTS, dtype=a.dtype, device=a.device)
    lo = torch.bucketize(a, bounds, right=False)
    hi = torch.bucketize(a, bounds, right=True)
    tie_up = torch.tensor((*_TIE_UP, False), device=a.device)
    idx = torch.where((lo != hi) & tie_up[lo], hi, lo)
    table = torch.tensor(E2M1_VALUES, dtype=a.dtype, device=a.device)
    return torch.copysign(table[idx], v)


def fp8_round_trip(x: Tensor, group: int = 32) -> Tensor:
    """The reference's ``act_quant(x, group, "ue8m0", inplace=True)``: E4M3 with power-of-two group scales."""
    g = _groups(x, group)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _ceil_pow2(amax * torch.tensor(1.0 / _FP8_MAX, dtype=torch.float32))
    q = (g / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2).to(x.dtype)


def fp4_round_trip(x: Tensor, group: int, scale: Literal["ue8m0", "e4m3"]) -> Tensor:
    """The reference's ``fp4_act_quant(x, group, inplace=True)`` with UE8M0 or E4M3 scales."""
    g = _groups(x, group)
    amax = g.abs().amax(-1, keepdim=True)
    if scale == "e4m3":
        s = (amax.clamp_min(6 * 2.0**-9) / _FP4_MAX).to(torch.float8_e4m3fn).float()
    else:
        s = _ceil_pow2(amax.clamp_min(6 * 2.0**-126) * torch.tensor(1.0 / _FP4_MAX, dtype=torch.float32))
    q = e2m1_round((g / s).clamp(-_FP4_MAX, _FP4_MAX))
    return (q * s).flatten(-2).to(x.dtype)
