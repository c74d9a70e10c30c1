"""Rotary position embedding, applied to the trailing channels of a head.

The rotated slice is ``x[..., -dims:]``. Two pairings of its channels (``RopeSpec.style``):

- ``"interleaved"`` (DeepSeek-V4): pair i is ``(x[..., 2i], x[..., 2i + 1])``;
- ``"half"`` (Qwen3, Llama as transformers writes them): pair i is ``(x[..., i], x[..., i + dims/2])``.

Frequencies may carry YaRN scaling.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.models.compressed.config import RopeSpec


def rope_inv_freq(dims: int, spec: RopeSpec) -> Float[Tensor, " pairs"]:
    """Inverse frequencies ``[dims // 2]`` of a RoPE with optional YaRN scaling (fp32)."""
    exponents = torch.arange(0, dims, 2, dtype=torch.float32) / dims
    base = spec.theta**exponents
    inv_freq = 1.0 / base
    if spec.yarn is None:
        return inv_freq
    yarn = spec.yarn

    def correction_dim(rotations: float) -> float:
        return dims * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dims - 1)
    if low == high:
        high += 1e-3  # avoid a zero-width ramp
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Low-frequency pairs (ramp -> 1) are interpolated by `factor`; high-frequency pairs keep their frequency.
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def apply_rope(
    x: Float[Tensor, "*batch pos head d"],
    positions: Tensor,
    inv_freq: Float[Tensor, " pairs"],
    *,
    attention_scaling: float = 1.0,
    inverse: bool = False,
    style: str = "interleaved",
) -> Float[Tensor, "*batch pos head d"]:
    """Rotate the trailing ``2 * len(inv_freq)`` channels of ``x`` at ``positions``.

    Args:
        x: ``[..., pos, head, d]``.
        positions: integer positions broadcastable to ``[..., pos]``.
        inv_freq: ``[pairs]`` inverse frequencies.
        inverse: rotate by ``-position`` (undo a rotation), as DeepSeek-V4 does on K=V attention outputs.
        style: ``"interleaved"`` or ``"half"`` pairing of the rotated channels (module docstring).
    """
    rope_dims = 2 * inv_freq.shape[0]
    if rope_dims == 0:
        return x
    ct = torch.promote_types(x.dtype, torch.float32)
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
