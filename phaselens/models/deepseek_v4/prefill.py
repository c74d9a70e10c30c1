"""Chunked prefill through the model's own cache.

An eager DeepSeek-V4 forward over T tokens builds ``[B, H, T, T + T/m]`` attention probabilities in every
layer. Chunked prefill runs the prefix in pieces of ``chunk`` tokens through a
``transformers.DynamicCache(config=...)`` (which builds V4's own sliding / CSA / HCA cache layers, so the
compressors carry their unfinished blocks and overlap halves across pieces), then runs the **query
chunk**, the last ``query_len`` tokens, as one more call. Only that last call is hooked and recorded.
Peak attention memory falls from ``O(T^2)`` to ``O(chunk * (chunk + L + T/m))``. The pieces are planned by
:func:`phaselens.models.parts.chunks.plan_chunks`; this module runs them through transformers.

With ``index_topk`` at least the number of entries, chunked and unchunked logits agree to float rounding
(tested at 1e-5 in fp32). Prefix pieces run under ``torch.no_grad()``: gradients stop at the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from phaselens.models.parts.chunks import ChunkPlan


@dataclass
class Prefilled:
    """A cache holding the plan's prefix ``tokens[:, :plan.query_start]``, and the prefix logits if they were kept."""

    cache: Any
    prefix_logits: list[Tensor]


def run_prefix(model: Any, tokens: Tensor, plan: ChunkPlan, *, keep_logits: bool) -> Prefilled:
    """Run the prefix pieces of ``plan`` through a fresh ``DynamicCache``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kept: list[Tensor] = []
    with torch.no_grad():
        for start, stop in plan.prefix:
            out = model(**call_kwargs(tokens[:, start:stop], start, cache, keep_logits=keep_logits))
            if keep_logits:
                kept.append(out.logits)
    return Prefilled(cache, kept)


def call_kwargs(tokens: Tensor, start: int, cache: Any, *, keep_logits: bool = True) -> dict[str, Any]:
    """Keyword arguments of one model call on ``tokens`` at slots ``start..``; ``cache=None``: uncached."""
    kwargs: dict[str, Any] = {"input_ids": tokens}
    if cache is None:
        kwargs["use_cache"] = False
        return kwargs
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
    kwargs.update(cache=cache, use_cache=True, position_ids=positions)
    if not keep_logits:
        kwargs["logits_to_keep"] = (
            1  # the lm_head over a long prefix is wasted work when only the query is wanted
        )
    return kwargs
