"""Greedy decoding over the model contract's forward, for lm-eval's ``generate_until``.

Prompts are batched right-padded: every prompt starts at slot 0 (left padding would move every token to another
slot, another phase), and a causal model's row never sees the padding after it. Each step is one forward of the
batch that unembeds only the rows it reads (each prompt's current last position, ``logits="query"``); the new
token is written right after each prompt's own end. Rows that met a stop string, the end-of-text token or their
budget leave the batch.
"""

from __future__ import annotations

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
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))  # similar lengths share a batch
    generated: list[list[int]] = [[] for _ in jobs]
    bar = tqdm(total=len(jobs), desc="phaselens generate_until", disable=disable)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
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
    """Decode the jobs ``rows`` together (right-padded), appending to ``generated``."""
    ends = torch.tensor([len(jobs[i][0]) for i in rows])
    width = int((ends + torch.tensor([jobs[i][2] for i in rows])).max())
    seqs = torch.full((len(rows), width), tokens.pad_id, dtype=torch.long)
    for r, i in enumerate(rows):
        seqs[r, : len(jobs[i][0])] = torch.tensor(jobs[i][0])
    active = torch.arange(len(rows))
    while len(active):
        upto = int(ends[active].max())
        logits = model_logits(model, seqs[active, :upto].to(device), (ends[active] - 1).to(device))
        at = (ends[active] - 1 - (upto - logits.shape[1])).to(logits.device)
        nxt = logits[torch.arange(len(active), device=logits.device), at].argmax(-1).cpu()
        seqs[active, ends[active]] = nxt
        ends[active] += 1
        keep = []
        for r, token in zip(active.tolist(), nxt.tolist()):
            job = rows[r]
            generated[job].append(int(token))
            if not _finished(tokens, generated[job], jobs[job][1], jobs[job][2]):
                keep.append(r)
        active = torch.tensor(keep, dtype=torch.long)


def _finished(tokens: Any, ids: list[int], stops: list[str], budget: int) -> bool:
    if len(ids) >= budget or (tokens.eos_id is not None and ids[-1] == tokens.eos_id):
        return True
    text = tokens.decode(ids, skip_special_tokens=False)
    return any(stop and stop in text for stop in stops)
