"""Attention probabilities of DeepSeek-V4 layers, split into local / entry / sink.

Every V4 layer runs one softmax over ``[raw keys | compressed entries | sink]``. transformers' eager
attention returns the probabilities with the sink column dropped, so the sink's share could only be
inferred as ``1 - row sum``. We instead tap the attention call, keep its output untouched, and recompute
the logits from the same ``query``, ``key`` and mask; the sink mass is then computed on its own,
``exp(sink - logsumexp(logits, sink))``, so "local + entry + sink = 1" is a real check.

The tap replaces the module-level ``eager_attention_forward`` of transformers' DeepSeek-V4 module (the
function its attention calls when ``_attn_implementation == "eager"``) for the duration of one forward,
and puts the previous one back in ``finally``. Modules other than the tapped ones pass straight through.
Each call runs the function the layer's numerics say (:func:`~.reference_ops.attention_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.models.deepseek_v4.reference_ops import attention_for, eager_attention

Tap = Callable[[Any, Tensor, Tensor, Tensor | None, float], None]


def attention_tap(taps: dict[int, Tap]) -> AbstractContextManager[None]:
    """While active, call ``taps[id(module)](module, query, key, mask, scaling)`` after each tapped attention.

    ``query`` is ``[B, H, n, d]`` after RoPE, ``key`` ``[B, 1, K, d]`` (raw keys then entries), ``mask`` the
    additive mask ``[B, 1, n, K]`` (or ``None``) exactly as the eager function received them.
    """

    def tapped(previous: Callable[..., Any], module: Any, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, *args: Any, **kwargs: Any):
        out = attention_for(module, previous)(module, query, key, value, attention_mask, *args, **kwargs)
        tap = taps.get(id(module))
        if tap is not None:
            scaling = kwargs["scaling"] if "scaling" in kwargs else args[0]
            tap(module, query, key, attention_mask, float(scaling))
        return out

    return eager_attention(tapped)


@dataclass(frozen=True)
class Split:
    """One layer's probabilities for the ``n`` query rows of a call (fp32).

    ``local[b, h, i, k]`` is the probability on slot ``q - L + 1 + k`` for query slot ``q = query_start + i``
    (0 where that slot is < 0); ``entry[b, h, i, j]`` on entry ``j`` (every entry in the cache, so indices
    are absolute under chunked prefill too); ``sink[b, h, i]`` on the sink.
    """

    local: Float[Tensor, "batch head query window"]
    entry: Float[Tensor, "batch head query entry"]
    sink: Float[Tensor, "batch head query"]


def split(
    query: Tensor,
    key: Tensor,
    mask: Tensor | None,
    sinks: Tensor,
    scaling: float,
    *,
    n_entries: int,
    query_start: int,
    window: int,
) -> Split:
    """Recompute the logits of one attention call and split the softmax.

    The raw keys are the first ``K - n_entries`` columns: the call's own tokens preceded by the ones kept in
    the sliding cache, so column ``c`` is slot ``query_start - kept + c`` with ``kept = K - n_entries - n``.
    """
    B, H, n, _ = query.shape
    logits = (
        torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    )  # [B, H, n, K]; key broadcasts
    if mask is not None:
        logits = logits + mask.float()
    sink_logits = sinks.float().view(1, H, 1).expand(B, H, n)
    lse = torch.logsumexp(torch.cat([logits, sink_logits.unsqueeze(-1)], dim=-1), dim=-1)  # [B, H, n]
    probs = torch.exp(logits - lse.unsqueeze(-1))
    sink = torch.exp(sink_logits - lse)
    n_raw = key.shape[2] - n_entries
    raw, entry = probs[..., :n_raw], probs[..., n_raw:]
    kept = n_raw - n
    i = torch.arange(n, device=query.device)[:, None]
    k = torch.arange(window, device=query.device)[None, :]
    col = i + k + 1 - window + kept  # [n, L]
    slot = query_start + i + k + 1 - window
    valid = (col >= 0) & (col < n_raw) & (slot >= 0)
    index = col.clamp(0, max(n_raw - 1, 0)).expand(B, H, n, window)
    local = torch.gather(raw, -1, index) * valid
    return Split(local, entry, sink)
