"""What a run on a served model costs, priced before it runs: requests, prompt tokens, what a prefix cache can
skip, and the time at a stated prefill rate.

Prompts are sent in the items' order (item-major for a paired task: one item's residues one after another),
so a prefix-caching server (vLLM, SGLang) can reuse the prompt a request shares with the one before it. The
plan counts that shared prefix in whole cache blocks (``block`` tokens; vLLM's default is 16), never the
last prompt token (a server always computes the position it answers from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from phaselens.errors import InputError

CACHE_BLOCK = 16


def shared_prefix(prompts: Sequence[np.ndarray]) -> np.ndarray:
    """``[N]``: the length of the prefix each prompt shares with the prompt before it (0 for the first)."""
    out = np.zeros(len(prompts), np.int64)
    for i in range(1, len(prompts)):
        a, b = prompts[i - 1], prompts[i]
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        out[i] = diff[0] if diff.size else n
    return out


def cacheable_tokens(prompts: Sequence[np.ndarray], block: int = CACHE_BLOCK) -> np.ndarray:
    """``[N]``: tokens of each prompt a prefix cache holding the previous prompt serves (whole blocks, never the
    last token)."""
    lengths = np.array([len(p) for p in prompts], np.int64)
    shared = np.minimum(shared_prefix(prompts), np.maximum(lengths - 1, 0))
    return (shared // block) * block


@dataclass(frozen=True)
class RequestPlan:
    """The price of a run on a served model (see the module docstring).

    Attributes:
        requests: prompts sent (items times ``copies``); ``seq_len``: the longest prompt.
        prompt_tokens: tokens in all prompts; ``cacheable_tokens``: those a prefix cache can serve;
            ``prefill_tokens``: what is left to compute.
        prefill_tokens_per_s: the stated rate; ``seconds``: ``prefill_tokens`` at that rate.
    """

    model: str
    task: str
    requests: int
    seq_len: int
    prompt_tokens: int
    cacheable_tokens: int
    prefill_tokens: int
    prefill_tokens_per_s: float
    seconds: float
    copies: int = 1

    @property
    def cache_saving(self) -> float:
        """The share of prompt tokens a prefix cache skips."""
        return self.cacheable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cache_saving": round(self.cache_saving, 4)}

    def __str__(self) -> str:
        hours = self.seconds / 3600
        return (f"RequestPlan({self.model} on {self.task}): {self.requests:,} requests of up to {self.seq_len:,} tokens"
                f"{f' ({self.copies} copies per item)' if self.copies > 1 else ''}; {self.prompt_tokens:,} prompt tokens, "
                f"{self.cacheable_tokens:,} ({100 * self.cache_saving:.1f}%) from a prefix cache, {self.prefill_tokens:,} "
                f"to prefill: {self.seconds:,.0f} s ({hours:.1f} h) at {self.prefill_tokens_per_s:,.0f} tokens/s")

    __repr__ = __str__


def plan_requests(task: Any, spec: Any, *, n_per_residue: int, residues: Any = None, seed: int = 0,
                  prefill_tokens_per_s: float = 10_000.0, copies: int = 1, sample: int = 2, model: str = "model",
                  block: int = CACHE_BLOCK) -> RequestPlan:
    """Price ``n_per_residue`` items per residue of ``task`` at ``spec`` from a sample of ``sample`` items per
    residue (built for real: lengths and shared prefixes are measured, then scaled). ``copies``: prompts per
    item (the shifted copies of ``repair_table``; copies share no prefix beyond BOS and are priced as such)."""
    from phaselens.core.checks import as_int

    n = as_int("n_per_residue", n_per_residue, minimum=1)
    copies = as_int("copies", copies, minimum=1)
    if not isinstance(prefill_tokens_per_s, int | float) or not prefill_tokens_per_s > 0:
        raise InputError(f"prefill_tokens_per_s must be a positive number, got {prefill_tokens_per_s!r}.")
    k = min(as_int("sample", sample, minimum=1), n)
    batch = task.build(spec, n_per_residue=k, residues=residues, seed=seed)
    ends = batch.query_pos.cpu().numpy().astype(np.int64) + 1
    rows = batch.tokens.cpu().numpy()
    prompts = [rows[i, : ends[i]] for i in range(len(ends))]
    scale = n / k
    total = float(ends.sum()) * scale * copies
    cached = float(cacheable_tokens(prompts, block).sum()) * scale if copies == 1 else 0.0
    name = str(getattr(batch, "task", type(task).__name__))
    left = int(round(total - cached))
    return RequestPlan(model, name, int(len(ends) * scale * copies), int(ends.max()), int(round(total)),
                       int(round(cached)), left, float(prefill_tokens_per_s), left / float(prefill_tokens_per_s),
                       copies)
