"""Rotary position embedding: inverse frequencies (plain, or with YaRN's frequency ramp) and the rotation of a
head's trailing channels.

YaRN (DeepSeek's reference ``inference/model.py`` ``precompute_freqs_cis``, and transformers'
``_compute_yarn_parameters`` with ``truncate=True``): with ``corr(r) = dims * ln(original / (2 pi r)) /
(2 ln theta)``, ``low = max(floor(corr(beta_fast)), 0)``, ``high = min(ceil(corr(beta_slow)), dims - 1)``, and
``ramp_i = clamp((i - low) / (high - low), 0, 1)`` over the ``dims / 2`` pairs, where a zero-width range
(``low == high``) becomes ``high + 0.001`` (both references' ``linear_ramp_factor``; a range with ``high < low``
is divided as it is). Pair ``i``'s frequency is ``inv_i / factor * ramp_i + inv_i * (1 - ramp_i)``: low
frequencies are interpolated by ``factor``, high ones keep theirs. No magnitude scaling here: a caller that
wants YaRN's ``attention_factor`` passes it to :func:`apply_rope`.

The rotated slice is ``x[..., -dims:]``, with two pairings of its channels:

- ``"interleaved"`` (DeepSeek-V4 / V4.1, the reference's complex multiply): pair ``i`` is
  ``(x[..., 2i], x[..., 2i + 1])``;
- ``"half"`` (Qwen3, Llama as transformers writes them): pair ``i`` is ``(x[..., i], x[..., i + dims/2])``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.models.parts.dtypes import compute_dtype

RopeStyle = Literal["interleaved", "half"]


def yarn_ramp(dims: int, theta: float, original: int, beta_fast: float, beta_slow: float) -> Float[Tensor, " pairs"]:
    """YaRN's interpolation weight ``[dims // 2]`` per pair (fp32): 0 keeps the frequency, 1 divides it by the
    factor (module docstring)."""

    def corrected(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corrected(beta_fast)), 0)
    high = min(math.ceil(corrected(beta_slow)), dims - 1)
    if low == high:
        high += 0.001  # a zero-width ramp, as DeepSeek's reference and transformers widen it
    return ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def inverse_frequencies(dims: int, theta: float, *, factor: float = 1.0, original: int = 0,
                        beta_fast: float = 32.0, beta_slow: float = 1.0) -> Float[Tensor, " pairs"]:
    """Inverse frequencies ``[dims // 2]`` (fp32) of a RoPE of base ``theta`` over ``dims`` channels: with YaRN
    when ``original`` (the pretraining length) is positive, else plain."""
    inv = 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))
    if original <= 0:
        return inv
    ramp = yarn_ramp(dims, theta, original, beta_fast, beta_slow)
    return inv / factor * ramp + inv * (1 - ramp)


def apply_rope(
    x: Float[Tensor, "*batch pos head d"],
    positions: Tensor,
    inv_freq: Float[Tensor, " pairs"],
    *,
    attention_scaling: float = 1.0,
    inverse: bool = False,
    style: RopeStyle = "interleaved",
) -> Float[Tensor, "*batch pos head d"]:
    """Rotate the trailing ``2 * len(inv_freq)`` channels of ``x`` at ``positions``.

    Args:
        x: ``[..., pos, head, d]``.
        positions: integer positions broadcastable to ``[..., pos]``.
        inv_freq: ``[pairs]`` inverse frequencies.
        attention_scaling: multiplies cos and sin (YaRN's magnitude scale; 1: none).
        inverse: rotate by ``-position`` (undo a rotation), as DeepSeek-V4 does on K=V attention outputs.
        style: ``"interleaved"`` or ``"half"`` pairing of the rotated channels (module docstring).

    The angles and the rotation run in at least fp32; the result is in ``x.dtype``.
    """
    rope_dims = 2 * inv_freq.shape[0]
    if rope_dims == 0:
        return x
    ct = compute_dtype(x.dtype)
    angles = positions.to(ct)[..., None] * inv_freq.to(device=x.device, dtype=ct)
    cos = (angles.cos() * attention_scaling).unsqueeze(-2)  # [..., pos, 1, pairs]
    sin = (angles.sin() * attention_scaling).unsqueeze(-2)
    if inverse:
        sin = -sin
    rot = x[..., -rope_dims:].to(ct)
    if style == "half":
        first, second = rot.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)
    else:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(x.dtype)
    if rope_dims == x.shape[-1]:
        return rotated
    return torch.cat([x[..., :-rope_dims], rotated], dim=-1)
