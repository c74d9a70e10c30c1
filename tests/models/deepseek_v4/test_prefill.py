"""DeepSeek-V4 adapter: chunked prefill through the model's own cache (equal logits, far less memory)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from phaselens.analyses.knockouts import knocked_out
from phaselens.models.deepseek_v4 import from_transformers
from tests.support.deepseek import (
    VOCAB,
    attention_modules,
    one_thread,  # noqa: F401  (autouse fixture)
    random_tokens,
    run_capturing,
    tiny_v4_model,
)
from tests.support.paths import ROOT

T = 37


@pytest.fixture(scope="module")
def adapter():
    return from_transformers(tiny_v4_model(seed=2))  # index_topk 64 >= the 9 entries at T = 37


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, T, seed=1)


@pytest.mark.parametrize(
    "chunk, query_len", [(5, None), (8, None), (16, None), (8, 3), (T - 1, 1), (64, None), (None, 4)]
)
def test_chunked_prefill_equals_the_unchunked_forward(adapter, tokens, chunk, query_len):
    with torch.no_grad():
        full = adapter(tokens)
        chunked = adapter(tokens, chunk=chunk, query_len=query_len)
        query = adapter(tokens, chunk=chunk, query_len=query_len, logits="query")
    assert chunked.shape == full.shape
    assert (chunked - full).abs().max() <= 1e-5
    n = query_len or min(chunk, T)
    assert query.shape == (2, n, VOCAB) and (query - full[:, -n:]).abs().max() <= 1e-5


def test_hooks_fire_only_for_the_query_chunk(adapter, tokens):
    names = [
        "blocks.1.attn.hook_z",
        "blocks.1.attn.hook_pattern_local",
        "blocks.1.attn.hook_pattern_entry",
        "blocks.2.attn.hook_pattern_sink",
        "blocks.2.attn.hook_pattern_entry",
        "blocks.1.attn.hook_gate",
        "blocks.1.attn.hook_entry",
        "blocks.2.attn.hook_gate",
        "blocks.3.attn.hook_indexer_topk",
    ]
    calls = []
    with torch.no_grad():
        _, full = adapter.run_with_cache(tokens, names_filter=names)
        with adapter.hooks(
            fwd_hooks=[
                (names, lambda t, *, hook: calls.append((hook.name, hook.query_start, hook.first_entry)))
            ]
        ):
            _, part = adapter.run_with_cache(tokens, names_filter=names, chunk=8)  # query chunk: slots 29..36
    assert len(calls) == len(names) and {c[1] for c in calls} == {29}
    firsts = {name: first for name, _, first in calls}
    assert part["blocks.1.attn.hook_z"].shape == (2, 8, 4, 64)
    assert (part["blocks.1.attn.hook_z"] - full["blocks.1.attn.hook_z"][:, -8:]).abs().max() <= 1e-5
    for name in names[1:5]:  # local band, entries (absolute indices) and sink: the last rows of the full run
        assert (part[name] - full[name][:, :, -8:]).abs().max() <= 1e-5, name
    # Gates of the entries completed in the query chunk, with windows that straddle the chunk boundary.
    for name, S in (("blocks.1.attn.hook_gate", 4), ("blocks.2.attn.hook_gate", 16)):
        first = firsts[name]
        assert first == 29 // S and part[name].shape[1] == 37 // S - first
        assert (part[name] - full[name][:, first:]).abs().max() <= 1e-6, name
    e = firsts["blocks.1.attn.hook_entry"]
    assert (part["blocks.1.attn.hook_entry"] - full["blocks.1.attn.hook_entry"][:, e:]).abs().max() <= 1e-5
    picks_part, picks_full = (
        part["blocks.3.attn.hook_indexer_topk"],
        full["blocks.3.attn.hook_indexer_topk"][:, -8:],
    )
    assert torch.equal(picks_part.sort(-1).values, picks_full.sort(-1).values)  # same sets (all entries kept)


def test_a_single_query_token_after_the_cache(adapter, tokens):
    """query_len=1 (one decode-like step): the HCA compressor then returns no block bias."""
    names = [
        "blocks.1.attn.hook_pattern_entry",
        "blocks.2.attn.hook_pattern_entry",
        "blocks.2.attn.hook_pattern_sink",
        "blocks.3.attn.hook_pattern_local",
        "blocks.1.attn.hook_z",
    ]
    with torch.no_grad():
        _, full = adapter.run_with_cache(tokens, names_filter=names)
        logits, one = adapter.run_with_cache(tokens, names_filter=names, chunk=8, query_len=1, logits="query")
    assert logits.shape == (2, 1, VOCAB)
    assert (one["blocks.1.attn.hook_z"] - full["blocks.1.attn.hook_z"][:, -1:]).abs().max() <= 1e-5
    for name in names[:4]:
        assert (one[name] - full[name][:, :, -1:]).abs().max() <= 1e-5, name


def test_knockout_under_chunked_prefill(adapter, tokens):
    with torch.no_grad():
        clean = adapter(tokens, chunk=8)
        with knocked_out(adapter, ["L1H0", "L3"], method="zero"):
            chunked = adapter(tokens, chunk=8)
            full = adapter(tokens)
    assert (chunked - full).abs().max() <= 1e-5
    assert (chunked[:, -1] - clean[:, -1]).abs().max() > 1e-3


def _attention_bytes(adapter, tokens, **kwargs) -> tuple[int, int, torch.Tensor]:
    """(largest, total) bytes of the eager attention-probability tensors ``[B, H, n, keys]`` of one call, and
    the logits.

    Read from each attention module's second output (what eager attention materialises); the prefix pieces
    of a chunked call count too.
    """

    def nbytes(args, out) -> int:  # sizes only: holding the tensors would raise this process's peak memory
        return out[1].numel() * out[1].element_size()

    logits, calls = run_capturing(adapter, tokens, attention_modules(adapter), keep=nbytes, **kwargs)
    sizes = [size for per_layer in calls.values() for size in per_layer]
    return max(sizes), sum(sizes), logits


def test_chunked_prefill_needs_far_less_attention_memory():
    adapter = from_transformers(tiny_v4_model(seed=2), index_topk="all")  # 256 entries at 1024 tokens: keep them all
    tokens = random_tokens(1, 1024, seed=3)
    big, _, full = _attention_bytes(adapter, tokens)
    small, _, chunked = _attention_bytes(adapter, tokens, chunk=64)
    assert big == 4 * 1024 * (1024 + 256) * 4  # [1, H=4, 1024, 1024 raw + 256 entries] fp32 in a CSA layer
    assert small <= 4 * 64 * (7 + 64 + 256) * 4  # 64 query rows over L-1 kept + 64 raw + <= 256 entries
    assert big / small > 15
    assert (chunked - full).abs().max() <= 1e-5


PROBE = textwrap.dedent(
    """
    import json, re, sys, torch
    torch.set_num_threads(1)
    from tests.support.deepseek import tiny_v4_model
    from phaselens.models.deepseek_v4 import from_transformers
    adapter = from_transformers(tiny_v4_model(seed=2), index_topk="all")
    tokens = torch.randint(0, 1000, (1, {T}), generator=torch.Generator().manual_seed(0))
    # The high-water mark of this process's own memory, MiB. Not ru_maxrss: exec hands the parent's peak on to
    # it, so a pytest process that has peaked above this probe's baseline would hide what the probe allocates.
    rss = lambda: int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) / 1024
    with torch.no_grad():
        adapter(tokens[:, :64])  # warm-up: allocator and lazy imports before the baseline
        base = rss()
        chunked = adapter(tokens, chunk={chunk}, logits="query")
        after_chunked = rss()  # measured first: the high-water mark only rises
        full = adapter(tokens, logits="query")
        after_full = rss()
    print(json.dumps(dict(base=base, chunked=after_chunked - base, unchunked=after_full - base,
                          diff=float((chunked - full[:, -chunked.shape[1]:]).abs().max()))))
    """
)


def test_peak_rss_chunked_vs_unchunked_in_a_subprocess():
    """Process peak memory (VmHWM), 2048 tokens: unchunked vs chunks of 256 (docs/deepseek_v4.md)."""
    code = PROBE.format(T=2048, chunk=256)
    out = subprocess.run(  # from the repository root, where `python -c` finds the tests package
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd=ROOT
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["diff"] <= 1e-5
    assert r["unchunked"] > 150 and r["unchunked"] > 5 * max(r["chunked"], 1.0), r
