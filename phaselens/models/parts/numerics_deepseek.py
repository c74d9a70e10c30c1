"""DeepSeek's numerics that the V4 adapter (its reference mixins) and V4.1's own model compute alike: the experts'
clamped SwiGLU, the hyper-connections' expansion of a sublayer output back onto the streams, and the sparse
indexer's scores."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from phaselens.models.parts.dtypes import compute_dtype


def swiglu(gate: Tensor, up: Tensor, limit: float, act: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """``act(gate) * up`` in the inputs' dtype (callers pass fp32), clamped as the reference clamps when
    ``limit > 0``: ``up`` both ways, ``gate`` from above."""
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return act(gate) * up


def mix_streams(
    out: Float[Tensor, "B S D"], streams: Float[Tensor, "B S hc D"], post: Tensor, comb: Tensor
) -> Float[Tensor, "B S hc D"]:
    """``post_k * out + sum_j comb[j, k] * streams_j`` in :func:`compute_dtype`, rounded once to ``out``'s
    dtype (the reference's ``hc_post``); ``post`` ``[B, S, hc]``, ``comb`` ``[B, S, hc, hc]``."""
    ct = compute_dtype(out.dtype)
    mixed = post.to(ct).unsqueeze(-1) * out.to(ct).unsqueeze(-2)
    return (mixed + torch.matmul(comb.to(ct).transpose(-1, -2), streams.to(ct))).to(out.dtype)


def index_scores(
    q: Float[Tensor, "B n H d"], keys: Float[Tensor, "B E d"], weights: Float[Tensor, "B n H"]
) -> Float[Tensor, "B n E"]:
    """The indexer's ``sum_h weights_h relu(q_h . k_e)`` in the queries' dtype, every step rounded to it as
    the reference's ``einsum`` does."""
    scores = torch.einsum("bnhd,bed->bnhe", q, keys.to(q.dtype))
    return (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
