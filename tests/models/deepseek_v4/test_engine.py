"""The DeepSeek-V4 adapter's query-suffix engine against full forwards with hand-written hooks.

The reference is the unchunked adapter (one uncached transformers forward over every token) with a hook at
``blocks.{l}.attn.hook_z`` that writes the cell's ``z`` at each row's query slot; it never goes through the
engine or the analyses. The tiny model has a sliding, a CSA (stride 4), an HCA (stride 16) and a second CSA
layer, so the cells cover every kind of layer.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.analyses.scoring import answer_metrics
from phaselens.contract.cells import Cell
from phaselens.contract.protocol import capability, choose_engine
from phaselens.errors import InputError
from tests.support.deepseek import one_thread, random_tokens, tiny_v4_fp64  # noqa: F401  (one_thread: fixture)

TOL = 1e-5
T = 50
# 47: (47 + 1) % 16 == 0, so the query completes a CSA and an HCA entry (the boundary phase); 33 and 22 are
# mid-block. Three query positions in one batch, one of them shared by two rows.
QUERY = torch.tensor([47, 33, 47, 22])


@pytest.fixture(scope="module")
def hf():
    # fp64: the engine and the forward sum in different orders, and in fp32 a last-bit difference could flip the
    # MoE router's top-2 or an indexer pick on some CPU; in fp64 they agree to ~1e-15 (answer metrics are then
    # scored in fp32, hence TOL)
    warnings.simplefilter("ignore")
    return tiny_v4_fp64(seed=3)


@pytest.fixture(scope="module")
def setup(hf):
    g = torch.Generator().manual_seed(11)
    tokens = random_tokens(len(QUERY), T, g)
    H, d = hf.config.num_attention_heads, hf.config.head_dim
    cells = [Cell(layer, [h]) for layer in range(4) for h in range(H)]  # every single-head zero knockout
    cells += [
        Cell(1, list(range(H))),  # the whole CSA layer
        Cell(2, [0, 3], torch.randn(2, d, generator=g)),  # shared replacement, HCA layer
        Cell(3, [1], torch.randn(len(QUERY), 1, d, generator=g)),  # per-item replacement
    ]
    ref_adapter = phaselens.from_hf(hf, index_topk="all")
    clean = _reference(ref_adapter, tokens, None)
    answer = clean.argmax(-1)
    answer[2:] = torch.randint(0, clean.shape[-1], (len(QUERY) - 2,), generator=g)  # some right, some wrong
    wrong = (answer + 1) % clean.shape[-1]
    refs = torch.stack([_reference(ref_adapter, tokens, c) for c in cells])
    return tokens, cells, clean, refs, answer, wrong


def _reference(adapter, tokens: torch.Tensor, cell: Cell | None) -> torch.Tensor:
    """Logits ``[N, V]`` at each row's query slot of one full forward, ``cell`` written by hand."""
    rows = torch.arange(len(QUERY))
    hooks = []
    if cell is not None:
        def fn(z, hook):
            z = z.clone()
            heads = torch.as_tensor(list(cell.heads))
            value = 0.0 if cell.replacement is None else cell.replacement.expand(len(QUERY), len(heads), -1)
            z[rows[:, None], QUERY[:, None], heads[None]] = value if cell.replacement is None else value.to(z.dtype)
            return z

        hooks = [(f"blocks.{cell.layer}.attn.hook_z", fn)]
    with torch.no_grad():
        return adapter.run_with_hooks(tokens, fwd_hooks=hooks)[rows, QUERY]


@pytest.mark.parametrize("chunk", [None, 3, 8, 20])
def test_every_cell_matches_the_full_forward(hf, setup, chunk):
    tokens, cells, clean, refs, answer, wrong = setup
    adapter = phaselens.from_hf(hf, index_topk="all", chunk=chunk)
    eng = adapter.query_engine(tokens, QUERY)
    assert len(eng.groups) == 3  # one cached prefix per query slot
    assert (eng.clean_logits - clean).abs().max() <= TOL
    got = eng.run(cells)
    assert got.shape == refs.shape
    assert (got - refs).abs().max() <= TOL
    assert (refs - clean).abs().amax(dim=(1, 2)).min() > 1e-4  # every cell changes the logits
    for c in range(len(cells)):
        m, r = answer_metrics(got[c], answer, wrong), answer_metrics(refs[c], answer, wrong)
        assert np.array_equal(m["correct"], r["correct"])
        assert np.abs(m["logit_diff"] - r["logit_diff"]).max() <= TOL
    flags = np.stack([answer_metrics(r, answer, wrong)["correct"] for r in refs])
    assert flags.any() and not flags.all()  # the correctness flags are informative


def test_boundary_entry_is_recomputed_with_the_intervention(hf, setup):
    """At the boundary query the completed entries pool the query's own token: reusing their clean value
    (a stale entry) changes the answer, and the engine matches the recomputed reference instead."""
    tokens, cells, _, refs, _, _ = setup
    adapter = phaselens.from_hf(hf, index_topk="all")
    cell_index = 0  # L0H0: every compressed layer above it sees an intervened query
    cell = cells[cell_index]
    entries = {}

    def grab(e, hook):
        entries[hook.name] = e.clone()

    def stale(e, hook):
        return entries[hook.name]  # clean entries: the query's completed entry not recomputed

    names = [f"blocks.{i}.attn.hook_entry" for i in (1, 2, 3)]
    with torch.no_grad():
        adapter.run_with_hooks(tokens, fwd_hooks=[(n, grab) for n in names])
    rows = torch.arange(len(QUERY))

    def zero(z, hook):
        z = z.clone()
        z[rows, QUERY, 0] = 0.0
        return z

    with torch.no_grad():
        wrong_way = adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero)]
                                           + [(n, stale) for n in names])[rows, QUERY]
    boundary = QUERY == 47
    assert (wrong_way[boundary] - refs[cell_index][boundary]).abs().max() > 1e-3  # the stale entry matters
    assert (wrong_way[~boundary] - refs[cell_index][~boundary]).abs().max() <= TOL  # only at the boundary
    got = phaselens.from_hf(hf, index_topk="all").query_engine(tokens, QUERY).run([cell])[0]
    assert (got - refs[cell_index]).abs().max() <= TOL


def test_empty_prefix_and_first_entry(hf):
    """Slot 0 (nothing cached: the query row runs on an empty cache) and slot 3 (completes CSA entry 0, with
    no earlier overlap half), chunked in pieces of 2."""
    adapter = phaselens.from_hf(hf, index_topk="all", chunk=2)
    reference = phaselens.from_hf(hf, index_topk="all")
    tokens, q, rows = random_tokens(2, 9, 2), torch.tensor([0, 3]), torch.arange(2)

    def zero(z, hook):
        z = z.clone()
        z[rows, q, 2] = 0.0
        return z

    got = adapter.query_engine(tokens, q).run([Cell(0, [2])])[0]
    with torch.no_grad():
        ref = reference.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero)])[rows, q]
    assert (got - ref).abs().max() <= TOL


def test_small_pass_budget_splits_passes_without_changing_numbers(hf, setup):
    tokens, cells, _, refs, _, _ = setup
    adapter = phaselens.from_hf(hf, index_topk="all", chunk=8)
    eng = adapter.query_engine(tokens, QUERY, pass_bytes=1)  # one cell per pass
    picked = [0, 5, 17, len(cells) - 1]
    got = eng.run([cells[i] for i in picked])
    assert (got - refs[picked]).abs().max() <= TOL


def test_the_capability_and_engine_choice(hf):
    adapter = phaselens.from_hf(hf)
    assert capability(adapter, "query_engine") is not None
    assert choose_engine(adapter, "auto") == "suffix"
    nn = phaselens.from_hf(hf, backend="nnsight")  # cells are written by the engine's own torch hooks
    assert choose_engine(nn, "auto") == "suffix"
    remote = phaselens.from_hf(hf, backend="nnsight", remote=True, numerics="transformers")
    assert capability(remote, "query_engine") is None  # no local cache to reuse
    assert choose_engine(remote, "auto") == "full"
    with pytest.raises(phaselens.errors.NotApplicableError, match="no query-suffix engine"):
        choose_engine(remote, "suffix")


def test_active_hooks_and_bad_slots_are_refused(hf):
    adapter = phaselens.from_hf(hf)
    tokens = random_tokens(2, 12, 0)
    with adapter.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: None)]):
        with pytest.raises(InputError, match="engine='full'"):
            adapter.query_engine(tokens, torch.tensor([11, 11]))
    with pytest.raises(InputError, match="query_pos"):
        adapter.query_engine(tokens, torch.tensor([11, 12]))


def test_binding_index_topk_equals_the_chunked_forward_with_the_same_pieces(hf):
    """With index_topk below the number of entries, the engine is exactly the adapter's chunked forward that
    prefills the same pieces (query_len=1): same indexer picks at the query, same cells to 1e-5. Against the
    uncached forward, picks can differ (tie-breaking of the prefix rows' picks, e.g. exact zeros of the
    ReLU scores, changes later layers); that is the chunked path's property, not the engine's."""
    k, n, L = 6, 6, 80  # 80 tokens: 20 CSA entries, 6 kept
    adapter = phaselens.from_hf(hf, index_topk=k, chunk=7)
    tokens = random_tokens(n, L, 5)
    q = torch.full((n,), L - 1)
    indexers = {i: hf.model.layers[i].self_attn.compressor.indexer for i in (1, 3)}
    picks: dict = {}

    def run_recording(tag, fn):
        def hook(key):
            def h(module, args, out):
                picks[(tag, key)] = out[:, -1].sort(-1).values  # the query row's picks [n, k]
            return h

        handles = [m.register_forward_hook(hook(i)) for i, m in indexers.items()]
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn()
        finally:
            for h in handles:
                h.remove()

    eng = run_recording("engine", lambda: adapter.query_engine(tokens, q))
    chunked = run_recording("chunked", lambda: adapter(tokens, query_len=1, logits="query")[:, -1])
    for i in indexers:
        assert torch.equal(picks[("engine", i)], picks[("chunked", i)])
    assert (eng.clean_logits - chunked).abs().max() <= TOL

    cells = [Cell(0, [1]), Cell(2, [0, 2])]

    def reference(cell):
        def fn(z, hook):
            z = z.clone()
            z[torch.arange(n), hook.rows(q, z.shape[1]), torch.as_tensor(list(cell.heads))[:, None]] = 0.0
            return z

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return adapter.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{cell.layer}.attn.hook_z", fn)],
                                          query_len=1, logits="query")[:, -1]

    got = eng.run(cells)
    for c, cell in enumerate(cells):
        assert (got[c] - reference(cell)).abs().max() <= TOL
