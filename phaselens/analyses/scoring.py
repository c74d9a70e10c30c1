"""Score a model on task items: logits at each item's query position, and answer metrics.

Shared by evaluation, ablation, patching and phase repair, so every analysis scores answers the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from phaselens.contract.finite import check_query_logits

Forward = Callable[[Tensor, Tensor, Tensor], Tensor]
# what answer_metrics returns; ``predicted`` is the greedy token (what the model said, right or not)
METRICS = ("correct", "p_correct", "p_wrong", "logit_diff", "nll", "rank", "predicted")
# the leading columns of a per-item frame (then the task's placement columns)
ITEM_COLUMNS = ["item_id", "residue", "phase", "t_K", "correct", "p_correct", "p_wrong", "logit_diff", "nll", "rank",
                "predicted"]


@torch.no_grad()
def query_logits(
    forward: Forward,
    tokens: Tensor,
    query_pos: Tensor,
    *,
    batch_size: int = 64,
    progress: bool = False,
    desc: str = "forward",
    model: Any = None,
) -> Tensor:
    """Logits ``[N, vocab]`` at ``query_pos`` ``[N]`` of ``tokens`` ``[N, T]``, one forward per batch.

    ``forward(tokens [b, T], query_pos [b], items [b]) -> logits [b, T', vocab]`` (the last ``T'`` rows): a
    model call, possibly under hooks that need each row's query slot or global item index (knockouts,
    patches).
    """
    starts = range(0, tokens.shape[0], batch_size)
    out = [block_logits(forward, tokens, query_pos, slice(i, i + batch_size)) for i in _bar(starts, progress, desc, model)]
    return torch.cat(out) if out else torch.zeros(0, 0)


@torch.no_grad()
def block_logits(forward: Forward, tokens: Tensor, query_pos: Tensor, block: slice) -> Tensor:
    """Query logits ``[b, vocab]`` (CPU, float) of the items in ``block`` (one forward; see :func:`query_logits`)."""
    start = block.start or 0
    qp = query_pos[block]
    logits = forward(tokens[block], qp, torch.arange(start, start + len(qp)))
    # a forward may return only the last rows (an adapter's query chunk): index relative to them
    at = (qp - (tokens.shape[1] - logits.shape[1])).to(logits.device)
    return logits[torch.arange(len(qp), device=logits.device), at].float().cpu()


def query_metrics(forward: Forward, batch: Any, *, batch_size: int = 64, progress: bool = False,
                  desc: str = "forward", model: Any = None, store: Any = None) -> dict[str, np.ndarray]:
    """:func:`answer_metrics` ``{name: [N]}`` of ``batch``, one forward per block of ``batch_size`` items.

    Under torch.distributed the blocks are split across ranks (:mod:`phaselens.parallel.distributed`); ``store`` (a
    journal of finished blocks, fields :data:`METRICS`) makes the pass resumable.
    """
    from phaselens.parallel.distributed import block_labels, item_blocks, shard_map

    blocks = item_blocks(int(batch.tokens.shape[0]), batch_size)
    parts = shard_map(lambda idx: [block_metrics(forward, batch, blocks[b]) for b in idx], block_labels(blocks),
                      store=store, progress=progress, stage=desc, model=model)
    return stack_metrics(parts)


def block_metrics(forward: Forward, batch: Any, block: slice) -> tuple[np.ndarray, ...]:
    """The :data:`METRICS` arrays ``[b]`` of the items in ``block`` (one forward)."""
    lg = block_logits(forward, batch.tokens, batch.query_pos, block)
    m = answer_metrics(lg, batch.answer[block], batch.wrong[block])
    return tuple(m[k] for k in METRICS)


def stack_metrics(parts: list[tuple[np.ndarray, ...]], names: tuple[str, ...] = METRICS, axis: int = 0
                  ) -> dict[str, np.ndarray]:
    """Per-block metric tuples joined in block order: ``{name: [N]}`` (``axis``: the items' axis)."""
    if not parts:
        return {k: np.zeros(0) for k in names}
    return {k: np.concatenate([p[j] for p in parts], axis) for j, k in enumerate(names)}


def items_from_metrics(batch: Any, metrics: dict[str, np.ndarray]) -> pd.DataFrame:
    """The per-item frame of ``batch``: its placement columns plus answer metrics ``{name: [N]}``."""
    frame = batch.frame.reset_index(drop=True).copy()
    for name, values in metrics.items():
        frame[name] = values
    frame["correct"] = frame["correct"].astype(bool)
    lead = [c for c in ITEM_COLUMNS if c in frame.columns]
    return frame[lead + [c for c in frame.columns if c not in lead]]


def items_from_logits(batch: Any, logits: Tensor) -> pd.DataFrame:
    """The per-item frame of ``batch`` scored from query logits ``[N, vocab]``."""
    return items_from_metrics(batch, answer_metrics(logits, batch.answer, batch.wrong))


def score_items(model: Any, batch: Any, *, batch_size: int = 64, progress: bool = False, forward: Any = None,
                desc: str = "evaluate", store: Any = None) -> pd.DataFrame:
    """Per-item frame of ``batch`` from one pass (item blocks split across ranks under torch.distributed;
    ``store``: a journal of finished blocks)."""
    metrics = query_metrics(forward or plain_forward(model), batch, batch_size=batch_size, progress=progress,
                            desc=desc, model=model, store=store)
    return items_from_metrics(batch, metrics)


def model_logits(model: Any, tokens: Tensor, query_pos: Tensor, fwd_hooks: Any = ()) -> Tensor:
    """Logits ``[b, T', vocab]`` of the last ``T' = T - min(query_pos)`` rows of ``tokens`` ``[b, T]``,
    with ``fwd_hooks`` for this one call.

    Only the query rows are unembedded (``logits="query"``, part of the model contract): all
    ``[b, T, vocab]`` logits of a long context would not fit in memory, and the unembedding is most of a
    small model's cost. A model that prefills in chunks (``returns_query_logits``) also hooks the query
    rows only.
    """
    kwargs: dict[str, Any] = {"logits": "query", "query_len": int(tokens.shape[1] - int(query_pos.min()))}

    def clean() -> Tensor:
        return model(tokens, **kwargs)

    def hooked() -> Tensor:
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)

    logits = hooked() if fwd_hooks else clean()
    # NaN/inf logits (a NaN weight) would become NaN effects: raise NonFiniteError naming the first bad layer
    check_query_logits(model, logits, int(tokens.shape[1]), query_pos, clean, hooked if fwd_hooks else None)
    return logits


def plain_forward(model: Any) -> Forward:
    """A ``Forward`` that just calls the model (query rows only)."""
    return lambda tokens, query_pos, items: model_logits(model, tokens, query_pos)


def answer_metrics(logits: Tensor, answer: Tensor, wrong: Tensor) -> dict[str, np.ndarray]:
    """Per-item metrics from query logits ``[N, vocab]`` (any device; results on the CPU).

    Returns arrays ``[N]``: ``correct`` (the answer is the strict top-1: a tie does not count),
    ``p_correct``, ``p_wrong``, ``logit_diff`` (answer minus wrong logit), ``nll`` (of the answer),
    ``rank`` (tokens scored strictly above it), ``predicted`` (the greedy token: the first top-1 id).
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
        "predicted": logits.argmax(-1).numpy(),
    }


def black_box_metrics(ans: Any, answer: Tensor) -> dict[str, np.ndarray]:
    """The :data:`METRICS` of a black-box model's answers (:class:`~phaselens.contract.answers.Answers`).

    ``correct``: the greedy token is the answer (greedy decoding takes the first of tied tokens, where
    :func:`answer_metrics` counts a tie as wrong). The log-probability metrics are NaN where the model did
    not report them; ``logit_diff`` is the log-probability difference, which equals the logit difference.
    ``rank`` is 0 for a right answer and NaN otherwise (a server reports no full ranking).
    """
    a = answer.cpu().numpy().astype(np.int64)
    correct = ans.predicted == a
    lp_a, lp_w = ans.logp_answer.astype(np.float64), ans.logp_wrong.astype(np.float64)
    return {"correct": correct, "p_correct": np.exp(lp_a), "p_wrong": np.exp(lp_w), "logit_diff": lp_a - lp_w,
            "nll": -lp_a, "rank": np.where(correct, 0.0, np.nan), "predicted": ans.predicted.astype(np.int64)}


def block_answers(model: Any, batch: Any, block: slice, *, progress: bool = False) -> tuple[np.ndarray, ...]:
    """The :data:`METRICS` arrays ``[b]`` of the items in ``block``, from a black-box model's answers
    (``progress``: the model's own bar over its requests)."""
    from phaselens.contract.protocol import require

    ask = require(model, "answer_queries", "a black-box model is scored from its answers.")
    ans = ask(batch.tokens[block], batch.query_pos[block], batch.answer[block], batch.wrong[block],
              progress=progress)
    m = black_box_metrics(ans, batch.answer[block])
    return tuple(m[k] for k in METRICS)


def _bar(it: Any, enabled: bool, desc: str, model: Any = None) -> Any:
    if not enabled:
        return it
    from phaselens.parallel.progress import progress_bar

    return progress_bar(it, stage=desc, model=model)
