"""Send many requests to one server at once, and keep prompts that share a prefix behind their first one.

Requests run on a pool of ``concurrency`` threads (threads, not an event loop, so a notebook's own loop is
never in the way). With ``warm_prefix``, a prompt that shares a long prefix with the one before it (the
residues of one item) waits until that one is answered, so a prefix-caching server (vLLM, SGLang) has the
shared part cached when the rest arrive and prefills it once. A progress bar counts requests and prompt
tokens per second. The first failure cancels what has not started and is raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from phaselens.runtime.request_plan import shared_prefix

MIN_SHARED = 256  # tokens of common prefix that make a prompt wait for the one before it


def leaders(prompts: Sequence[np.ndarray], min_shared: int = MIN_SHARED) -> np.ndarray:
    """``[N]``: the index of the prompt each one waits for (itself when it waits for none): the first of each
    run of prompts that share at least ``min_shared`` tokens with their predecessor."""
    lead = np.arange(len(prompts))
    shared = shared_prefix(prompts)
    for i in range(1, len(prompts)):
        if shared[i] >= min_shared:
            lead[i] = lead[i - 1]
    return lead


def dispatch(send: Callable[[int], Any], n: int, *, concurrency: int, lead: np.ndarray | None = None,
             progress: bool = False, stage: str = "requests", model: Any = None,
             tokens: Callable[[Any], int] | None = None) -> list[Any]:
    """``[send(0), ..., send(n - 1)]`` with up to ``concurrency`` in flight; ``lead[i] != i`` holds request
    ``i`` back until request ``lead[i]`` is answered. ``tokens(result)`` feeds the bar's tokens/s."""
    results: list[Any] = [None] * n
    if n == 0:
        return results
    lead = np.arange(n) if lead is None else np.asarray(lead)
    followers: dict[int, list[int]] = {}
    for i in np.flatnonzero(lead != np.arange(n)):
        followers.setdefault(int(lead[i]), []).append(int(i))
    from phaselens.parallel.progress import progress_bar

    bar = progress_bar(stage=stage, unit="req", total=n, model=model) if progress else None
    start, done_tokens = time.monotonic(), 0
    pool = ThreadPoolExecutor(max_workers=max(1, int(concurrency)), thread_name_prefix="phaselens-served")
    running: dict[Future, int] = {}
    try:
        for i in np.flatnonzero(lead == np.arange(n)).tolist():
            running[pool.submit(send, i)] = i
        while running:
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in finished:
                i = running.pop(fut)
                results[i] = fut.result()  # the first error propagates (the rest are cancelled below)
                for k in followers.pop(i, ()):
                    running[pool.submit(send, k)] = k
                if bar is not None:
                    done_tokens += int(tokens(results[i])) if tokens is not None else 0
                    rate = done_tokens / max(time.monotonic() - start, 1e-9)
                    bar.set_postfix_str(f"{rate:,.0f} prompt tok/s", refresh=False)
                    bar.update(1)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if bar is not None:
            bar.close()
    return results
