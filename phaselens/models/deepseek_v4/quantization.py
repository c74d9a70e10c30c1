"""The quantization steps of DeepSeek's V4 inference, as plain tensor functions.

DeepSeek's ``inference/model.py`` calls "fused quant + dequant" steps on some activations, to match what the
model saw in quantization-aware training. The round trips themselves (formats, scales, rounding) are the
shared ones of :mod:`phaselens.models.parts.formats`; V4 differs in where it applies them and in its blocks:

* **FP8** (``e4m3``) on the non-RoPE dims of the window KV of every layer and of the compressed entries, in
  blocks of 64 channels (:func:`fp8_simulate`). As the published ``kernel.py`` is written this step does not
  round: with ``inplace=True`` its ``act_quant`` casts ``x / s`` to its output dtype, which is then the
  input's (bf16), and back, so a bf16 input comes out unchanged. :func:`fp8_simulate` rounds through e4m3
  instead, as an FP8 KV cache (or an FP8 attention kernel reading one) does: ``quantize="fp8"``.
* a **Hadamard rotation** (Sylvester order, scaled by ``n**-0.5``) then **FP4** (``e2m1``, power-of-two
  scales) on the indexer's queries and compressed keys, in blocks of 32 channels (:func:`indexer_simulate`);
  the published ``fp4_act_quant`` does round through FP4 (``quantize="published"`` and ``"fp8"`` both do this).

These functions do the arithmetic only; :mod:`.numerics` places them in a transformers model.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.errors import InputError
from phaselens.models.parts.formats import fp4_round_trip, fp8_round_trip

FP8_BLOCK = 64  # channels per scale: window KV and compressed entries (non-RoPE dims)
FP4_BLOCK = 32  # channels per scale: indexer q and k


def fp8_simulate(x: Float[Tensor, "... n"]) -> Float[Tensor, "... n"]:
    """V4's FP8 step: round ``x`` through E4M3 in blocks of :data:`FP8_BLOCK` channels and back, in ``x``'s
    dtype and shape."""
    return fp8_round_trip(x, FP8_BLOCK)


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
    return fp4_round_trip(hadamard(x), FP4_BLOCK, "ue8m0")
