"""Score a model on task items: logits at each item's query position, and answer metrics.

Shared by evaluation, ablation, patching and phase repair, so every analysis scores answers the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

Forward = Callable[[Tensor, Tensor], Tensor]


@torch.no_grad()
def query_logits(
    forward: Forward,
    tokens: Tensor,
    query_pos: Tensor,
    *,
    batch_size: int = 64,
    progress: bool = False,
    desc: str = "forward",
) -> Tensor:
    """Logits ``[N, vocab]`` at ``query_pos`` ``[N]`` of ``tokens`` ``[N, T]``, one forward per batch.

    ``forward(tokens [b, T], query_pos [b]) -> logits [b, T, vocab]``: a model call, possibly under
    hooks that need each row's query position (knockouts, patches).
    """
    out = []
    starts = range(0, tokens.shape[0], batch_size)
    for i in _bar(starts, progress, desc):
        qp = query_pos[i : i + batch_size]
        logits = forward(tokens[i : i + batch_size], qp)
        # a forward may return only the last rows (an adapter's query chunk): index relative to them
        at = (qp - (tokens.shape[1] - logits.shape[1])).to(logits.device)
        out.append(logits[torch.arange(len(qp), device=logits.device), at].float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


def model_logits(model: Any, tokens: Tensor, query_pos: Tensor, fwd_hooks: Any = ()) -> Tensor:
    """Logits ``[b, T', vocab]`` of ``tokens`` ``[b, T]``, with ``fwd_hooks`` for this one call.

    A model that prefills in chunks (``returns_query_logits``, e.g. the DeepSeek-V4 adapter) is asked for
    the last ``T' = T - min(query_pos)`` rows only: all ``[b, T, vocab]`` logits of a long context would
    not fit in memory. Other models return all ``T`` rows.
    """
    kwargs: dict[str, Any] = {}
    if getattr(model, "returns_query_logits", False):
        kwargs = {"logits": "query", "query_len": int(tokens.shape[1] - int(query_pos.min()))}
    if fwd_hooks:
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)
    return model(tokens, **kwargs)


def plain_forward(model: Any) -> Forward:
    """A ``Forward`` that just calls the model (query rows only where the model can)."""
    return lambda tokens, query_pos: model_logits(model, tokens, query_pos)


def answer_metrics(logits: Tensor, answer: Tensor, wrong: Tensor) -> dict[str, np.ndarray]:
    """Per-item metrics from query logits ``[N, vocab]`` (any device; results on the CPU).

    Returns arrays ``[N]``: ``correct`` (the answer is the strict top-1: a tie does not count),
    ``p_correct``, ``p_wrong``, ``logit_diff`` (answer minus wrong logit), ``nll`` (of the answer),
    ``rank`` (tokens scored strictly above it).
    """
    logits = logits.detach().float().cpu()
    idx = torch.arange(logits.shape[0])
    answer, wrong = answer.cpu().long(), wrong.cpu().long()
    logp = logits.log_softmax(-1)
    a_logit = logits[idx, answer]
    rank = (logits > a_logit[:, None]).sum(-1)
    ties = (logits == a_logit[:, None]).sum(-1) - 1
    return {
        "correct": ((rank == 0) & (ties == 0)).numpy(),
        "p_correct": logp[idx, answer].exp().numpy(),
        "p_wrong": logp[idx, wrong].exp().numpy(),
        "logit_diff": (a_logit - logits[idx, wrong]).numpy(),
        "nll": (-logp[idx, answer]).numpy(),
        "rank": rank.numpy(),
    }


def _bar(it: Any, enabled: bool, desc: str) -> Any:
    if not enabled:
        return it
    from phaselens.progress import progress_bar

    return progress_bar(it, stage=desc)
