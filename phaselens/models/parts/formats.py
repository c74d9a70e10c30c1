"""FP8 (E4M3) and FP4 (E2M1) numbers, and the block-scaled quantize-dequantize round trips DeepSeek-V4 and V4.1
apply to activations (their reference ``inference/kernel.py``'s ``act_quant`` and ``fp4_act_quant``).

Formats:

* **E4M3** (``torch.float8_e4m3fn``): largest finite value 448; rounding is torch's cast (to nearest, ties to
  the even mantissa).
* **E2M1** (FP4): the magnitudes :data:`E2M1_VALUES` ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` and a sign bit (code
  ``c``: magnitude ``E2M1_VALUES[c & 7]``, negative when ``c & 8``); :func:`round_e2m1` rounds to nearest, ties to
  the even code.

A round trip splits the last axis into blocks of ``block`` channels, gives each block one scale ``s`` from its
largest magnitude ``amax`` (floored), and returns ``round(clamp(x / s, -qmax, qmax)) * s`` in fp32, cast back to
the input's dtype. Scales:

* ``"ue8m0"``: ``s = 2**ceil(log2(amax * fp32(1/qmax)))`` (:func:`pow2_scale`), computed exactly from the
  float's exponent and mantissa as the reference's kernels read them. ``x / s`` and the product are then exact:
  only the rounding to the grid loses information. ``amax`` is floored at :data:`FP8_AMAX_FLOOR` (FP8) or
  :data:`FP4_AMAX_FLOOR` (FP4).
* ``"e4m3"`` (FP4 only, DeepSeek-V4.1's compressed KV): ``s = e4m3(max(amax, 6 * 2**-9) / 6)``, not a power of
  two.

Every function is vectorised over all leading axes.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.core import margins
from phaselens.errors import InputError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest E2M1 magnitude
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code c & 7
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # ue8m0 scales
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # e4m3 scales

Scale = Literal["ue8m0", "e4m3"]


def pow2_scale(amax: Float[Tensor, "*shape"], qmax: float) -> Float[Tensor, "*shape"]:
    """``2**ceil(log2(amax * fp32(1/qmax)))`` in fp32, exactly (from the exponent and mantissa: no log/exp
    rounding), for positive normal ``amax``."""
    v = amax.float() * torch.tensor(1.0 / qmax, dtype=torch.float32, device=amax.device)
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two keeps its exponent
    return torch.ldexp(torch.ones_like(v), exponent)


def round_e2m1(v: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """Round values in ``[-6, 6]`` to the nearest E2M1 value, ties to the even code (NaN stays NaN).

    The grid is 0, 0.5, 1, 1.5 (step 0.5), 2, 3 (step 1), 4, 6 (step 2). Within each step the even multiples of
    the step are the even codes, so ``torch.round`` (half to even) of ``v / step`` is the format's rounding; the
    step is a power of two, so the division and product are exact.
    """
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def _blocks(x: Tensor, block: int, what: str) -> Tensor:
    """``x`` ``[..., n]`` as fp32 ``[..., n / block, block]``."""
    n = x.shape[-1]
    if block < 1 or n % block:
        raise InputError(
            f"{what} quantizes blocks of {block} channels, but the last dimension is {n}: it needs a multiple "
            f"of {block} (DeepSeek's released models have it)."
        )
    return x.float().unflatten(-1, (n // block, block))


def fp8_round_trip(x: Float[Tensor, "*batch n"], block: int) -> Float[Tensor, "*batch n"]:
    """Round ``x`` through E4M3 with one ``ue8m0`` scale per ``block`` channels and back, in ``x``'s dtype: the
    reference's ``act_quant(x, block, "ue8m0", inplace=True)`` as an FP8 kernel (or FP8 KV cache) rounds.
    Reports its rounding margins to an active :mod:`~phaselens.core.margins` recorder."""
    out = _fp8(x, block)
    if margins.active() is not None:
        margins.note_round_trip(lambda v: _fp8(v, block), x, out)
    return out


def _fp8(x: Tensor, block: int) -> Tensor:
    b = _blocks(x, block, "the FP8 round trip")
    s = pow2_scale(b.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR), FP8_MAX)
    q = (b / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # to nearest, ties to even
    return (q * s).flatten(-2).to(x.dtype)


def fp4_round_trip(x: Float[Tensor, "*batch n"], block: int, scale: Scale = "ue8m0") -> Float[Tensor, "*batch n"]:
    """Round ``x`` through E2M1 with one scale per ``block`` channels and back, in ``x``'s dtype: the reference's
    ``fp4_act_quant(x, block, inplace=True)``. ``scale``: ``"ue8m0"`` (power of two) or ``"e4m3"`` (module
    docstring). Reports its rounding margins to an active :mod:`~phaselens.core.margins` recorder."""
    out = _fp4(x, block, scale)
    if margins.active() is not None:
        margins.note_round_trip(lambda v: _fp4(v, block, scale), x, out)
    return out


def _fp4(x: Tensor, block: int, scale: Scale) -> Tensor:
    b = _blocks(x, block, "the FP4 round trip")
    amax = b.abs().amax(-1, keepdim=True)
    if scale == "e4m3":
        s = (amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX).to(torch.float8_e4m3fn).float()
    elif scale == "ue8m0":
        s = pow2_scale(amax.clamp_min(FP4_AMAX_FLOOR), FP4_MAX)
    else:
        raise InputError(f"scale must be 'ue8m0' or 'e4m3', got {scale!r}.")
    q = round_e2m1((b / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2).to(x.dtype)
