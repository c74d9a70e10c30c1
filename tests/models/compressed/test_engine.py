"""The query-suffix engine equals the naive full-forward knockout at every phase, boundary included."""

from __future__ import annotations

import pytest
import torch

from phaselens.contract.cells import Cell
from phaselens.models.compressed.engine import SuffixEngine
from tests.support.models import LAYOUTS, make_model

CASES = [("w8s4-deepseek", q) for q in (20, 21, 22, 23)] + [("w4s4-scalar", 23), ("w4s4-scalar", 21),
                                                               ("w8s4-peroffset", 23), ("w6s3-uniform", 23)]


@pytest.mark.parametrize("name, q", CASES)  # q = 20..23 are phases 0..3 for S = 4; 23 is the boundary
def test_engine_equals_full_forward_knockouts(name, q):
    model = make_model(LAYOUTS[name], n_layers=3)
    tokens = torch.randint(0, 61, (4, 30), generator=torch.Generator().manual_seed(q))
    eng = SuffixEngine(model, tokens, q, rows_per_pass=9)  # small passes: cells split across passes
    with torch.no_grad():
        assert (eng.clean_logits - model(tokens[:, : q + 1])[:, q]).abs().max() <= 1e-5
    g = torch.Generator().manual_seed(1)
    cells = [Cell(layer, [h], torch.randn(1, 8, generator=g)) for layer in range(3) for h in range(4)]
    cells += [Cell(1, [0, 1], None), Cell(0, [2], torch.randn(4, 1, 8, generator=g))]
    out = eng.run(cells)
    for cell, got in zip(cells, out):
        def hook(z, hook, cell=cell):
            z = z.clone()
            r = torch.zeros(len(cell.heads), 8) if cell.replacement is None else cell.replacement
            z[:, q, list(cell.heads)] = r
            return z

        with torch.no_grad():
            ref = model.run_with_hooks(tokens[:, : q + 1], fwd_hooks=[(f"blocks.{cell.layer}.attn.hook_z", hook)])[:, q]
        assert (ref - got).abs().max() <= 1e-5
    assert (out[0] - eng.clean_logits).abs().max() > 1e-3  # the interventions do something


def test_boundary_query_recomputes_the_entry_it_completes():
    """At the boundary phase the entry completing at the query pools the query token: upper layers must see
    the intervened residual in it. Freezing that entry instead would give different logits."""
    model = make_model(LAYOUTS["w4s4-scalar"], n_layers=2, local_window=1)
    tokens = torch.randint(0, 61, (3, 24), generator=torch.Generator().manual_seed(5))
    q = 23
    eng = SuffixEngine(model, tokens, q)
    cell = Cell(0, [0, 1, 2, 3], None)  # knock out all of layer 0 at the query
    got = eng.run([cell])[0]

    def hook(z, hook):
        z = z.clone()
        z[:, q] = 0
        return z

    with torch.no_grad():
        ref = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", hook)])[:, q]
        _, cache = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_entry_k")
    assert (ref - got).abs().max() <= 1e-5
    assert cache["blocks.1.attn.hook_entry_k"].shape[1] == 6  # entry 5 completes exactly at slot 23


def test_query_engine_with_different_query_positions_per_row():
    """Rows whose query slots differ (a regression: the first row's slot was used for every row) are
    grouped by slot; every cell equals the full forward at each row's own slot."""
    model = make_model(LAYOUTS["w8s4-deepseek"], n_layers=2)
    tokens = torch.randint(0, 61, (5, 30), generator=torch.Generator().manual_seed(2))
    qp = torch.tensor([23, 20, 23, 29, 21])
    eng = model.query_engine(tokens, qp)
    g = torch.Generator().manual_seed(3)
    cells = [Cell(0, [1], torch.randn(5, 1, 8, generator=g)), Cell(1, [0, 3], None)]
    out = eng.run(cells)
    for cell, got in zip(cells, out):
        def hook(z, hook, cell=cell):
            z = z.clone()
            rows = torch.arange(z.shape[0])
            r = torch.zeros(5, len(cell.heads), 8) if cell.replacement is None else cell.replacement
            z[rows[:, None], qp[:, None], torch.tensor(cell.heads)[None]] = r
            return z

        with torch.no_grad():
            ref = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{cell.layer}.attn.hook_z", hook)])
        assert (ref[torch.arange(5), qp] - got).abs().max() <= 1e-5
    with torch.no_grad():
        assert (model(tokens)[torch.arange(5), qp] - eng.clean_logits).abs().max() <= 1e-5
