"""Greedy decoding over the model contract's forward, for lm-eval's ``generate_until``.

Prompts of one length share a batch, so no prompt is padded (left padding would move every token to another
slot, another phase). Each step is one forward that unembeds only the last row (``logits="query"``); rows
that met a stop string, the end-of-text token or their budget leave the batch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from tqdm.auto import tqdm

from phaselens.analyses.scoring import model_logits

GREEDY_ONLY = "phaselens decodes greedily (it scores what the model answers); sampling options are not supported"


@torch.no_grad()
def greedy_decode(model: Any, tokens: Any, jobs: list[tuple[list[int], list[str], int]], *, batch_size: int,
                  device: Any, disable: bool = False) -> list[str]:
    """The greedy continuation of each job ``(prompt ids, stop strings, budget)`` as text (special tokens
    skipped, cut at the end-of-text token; the caller cuts at the stop strings). ``tokens`` is a
    :class:`~phaselens.integrations.lm_eval.tokens.TokenizerView`."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, (ids, _, _) in enumerate(jobs):
        by_length[len(ids)].append(i)
    generated: list[list[int]] = [[] for _ in jobs]
    bar = tqdm(total=len(jobs), desc="phaselens generate_until", disable=disable)
    for _, members in sorted(by_length.items(), reverse=True):
        for start in range(0, len(members), batch_size):
            rows = members[start:start + batch_size]
            _decode_rows(model, tokens, jobs, rows, generated, device)
            bar.update(len(rows))
    bar.close()
    out = []
    for ids in generated:
        if tokens.eos_id is not None and tokens.eos_id in ids:
            ids = ids[:ids.index(tokens.eos_id)]
        out.append(tokens.decode(ids, skip_special_tokens=True))
    return out


def _decode_rows(model: Any, tokens: Any, jobs: list[tuple[list[int], list[str], int]], rows: list[int],
                 generated: list[list[int]], device: Any) -> None:
    """Decode the jobs ``rows`` (prompts of one length) together, appending to ``generated``."""
    seqs = torch.tensor([jobs[i][0] for i in rows], dtype=torch.long, device=device)
    active = list(range(len(rows)))
    for _ in range(max(jobs[i][2] for i in rows)):
        live = torch.tensor(active, device=device)
        current = seqs[live]
        query = torch.full((len(active),), current.shape[1] - 1, dtype=torch.long, device=device)
        nxt = model_logits(model, current, query)[:, -1].argmax(-1)
        grown = torch.cat([seqs, torch.full((len(rows), 1), tokens.pad_id, dtype=torch.long, device=device)], 1)
        grown[live, -1] = nxt
        seqs = grown
        still = []
        for a, token in zip(active, nxt.tolist()):
            job = rows[a]
            generated[job].append(int(token))
            if not _finished(tokens, generated[job], jobs[job][1], jobs[job][2]):
                still.append(a)
        active = still
        if not active:
            return


def _finished(tokens: Any, ids: list[int], stops: list[str], budget: int) -> bool:
    if len(ids) >= budget or (tokens.eos_id is not None and ids[-1] == tokens.eos_id):
        return True
    text = tokens.decode(ids, skip_special_tokens=False)
    return any(stop and stop in text for stop in stops)
