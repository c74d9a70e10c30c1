"""The zoo transformer's RoPE: a :class:`~phaselens.models.compressed.config.RopeSpec` read into the shared
frequencies of :mod:`phaselens.models.parts.rope`.

The rotated slice is ``x[..., -dims:]``, paired ``"interleaved"`` (DeepSeek-V4) or ``"half"`` (Qwen3, Llama)
as ``RopeSpec.style`` says; frequencies may carry YaRN scaling (``RopeSpec.yarn``).
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from phaselens.models.compressed.config import RopeSpec
from phaselens.models.parts.rope import apply_rope, inverse_frequencies

# compressor.py imports apply_rope from here (to move to numerics.rope); new code imports it from there
__all__ = ["apply_rope", "rope_inv_freq"]


def rope_inv_freq(dims: int, spec: RopeSpec) -> Float[Tensor, " pairs"]:
    """Inverse frequencies ``[dims // 2]`` (fp32) of ``spec``'s RoPE over ``dims`` channels, with its YaRN scaling
    if it has one (the magnitude scale ``spec.yarn.attention_factor`` is the caller's, at rotation)."""
    yarn = spec.yarn
    if yarn is None:
        return inverse_frequencies(dims, spec.theta)
    return inverse_frequencies(dims, spec.theta, factor=yarn.factor, original=yarn.original_max_position,
                               beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
