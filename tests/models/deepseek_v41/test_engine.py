"""DeepSeek-V4.1's query-suffix engine equals full forwards with the cell written at the query slot.

Every head of every layer of the tiny checkpoint (sliding layers, ratio-2 and ratio-1 compressed layers, layers
that read another layer's entries and picks, the candidate filter), at both phases of the period (the odd slot
completes a ratio-2 entry that pools the intervened query row), in every ``quantize`` setting, with and without
Engram, packed and dequantized weights.

Exactness is checked in fp64 (to ``TOL`` = 1e-10; the two paths agree to about 1e-14), where no rounding can flip
a discrete step: a top-k pick of the indexer, the MoE router's top-2, an FP8 rounding. In fp32 a 1e-7 difference
of summation order (a pass runs ``C x n`` rows, a forward ``n``; another CPU sums in another order) can flip one
such step, and the cell then moves by a whole pick or quantization step on that machine only.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.contract.cells import Cell
from phaselens.errors import InputError
from phaselens.models.deepseek_v41 import load_v41
from phaselens.models.deepseek_v41.engine import V41SuffixEngine
from phaselens.models.parts.index_topk import IndexTopKWarning
from tests.support.deepseek_v41 import write_tiny_checkpoint

TOL = 1e-10  # fp64
N_ITEMS, T = 3, 30


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41e")
    return {False: write_tiny_checkpoint(root / "plain"), True: write_tiny_checkpoint(root / "engram", engram=True)}


def tokens(vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (N_ITEMS, T), generator=torch.Generator().manual_seed(seed))


def every_head_cells(n_layers: int, n_heads: int, head_dim: int, seed: int = 1) -> list[Cell]:
    """One cell per (layer, head) with a random replacement, plus a zero knockout of several heads and a
    per-item replacement: ``n_layers * n_heads + 2`` cells."""
    g = torch.Generator().manual_seed(seed)
    cells = [Cell(layer, [h], torch.randn(1, head_dim, generator=g))
             for layer in range(n_layers) for h in range(n_heads)]
    cells.append(Cell(2, [0, 2, 3], None))
    cells.append(Cell(4, [1], torch.randn(N_ITEMS, 1, head_dim, generator=g)))
    return cells


def full_forward(model, toks: torch.Tensor, q: int, cell: Cell) -> torch.Tensor:
    """Logits ``[n, V]`` at slot ``q`` of a full forward with ``cell`` written into ``hook_z`` at ``q``."""
    def write(z, hook):
        z = z.clone()
        heads = list(cell.heads)
        r = torch.zeros(len(heads), z.shape[-1]) if cell.replacement is None else cell.replacement
        z[:, q, heads] = r.to(z.dtype)
        return z

    with torch.no_grad():
        return model.run_with_hooks(toks[:, : q + 1], fwd_hooks=[(f"blocks.{cell.layer}.attn.hook_z", write)])[:, q]


def engine_errors(model, toks: torch.Tensor, q: int, *, rows_per_pass: int = 4096) -> np.ndarray:
    """Per cell, the largest difference between the engine and a full forward (every head of every layer, plus
    two multi-head / per-item cells); asserts the clean logits too."""
    eng = V41SuffixEngine(model, toks, q, rows_per_pass=rows_per_pass)
    with torch.no_grad():
        clean = model(toks[:, : q + 1])[:, q]
    assert (eng.clean_logits - clean).abs().max() <= TOL
    n_layers = len(model.blocks)
    n_heads, head_dim = eng.clean_z[0].shape[1:]
    cells = every_head_cells(n_layers, n_heads, head_dim)
    out = eng.run(cells)
    assert out.shape == (len(cells), N_ITEMS, clean.shape[-1])
    moved = (out - eng.clean_logits).abs().amax(dim=(1, 2))
    assert (moved > 1e-4).float().mean() > 0.9  # the cells change the logits: the comparison is not vacuous
    return np.array([float((full_forward(model, toks, q, cell) - got).abs().max()) for cell, got in zip(cells, out)])


def check_engine(model, toks: torch.Tensor, q: int, **kw) -> float:
    return float(engine_errors(model, toks, q, **kw).max())


@pytest.mark.parametrize("engram", [False, True])
@pytest.mark.parametrize("quantize", [None, "kv"])
def test_engine_equals_full_forwards_on_every_head(ckpts, engram, quantize):
    model = load_v41(ckpts[engram], dtype=torch.float64, index_topk="all", quantize=quantize)
    toks = tokens()
    for q in (20, 21):  # phase 0 and the boundary phase 1 (slot 21 completes a ratio-2 entry)
        assert check_engine(model, toks, q) <= TOL


@pytest.mark.parametrize("engram", [False, True])
def test_fp8_engine_is_exact_in_fp64_and_reports_its_rounding_margins_in_fp32(ckpts, engram):
    """quantize='fp8' rounds activations to FP8 before every GEMM, so a difference of summation order (a pass runs
    C x n rows, a forward n; another CPU sums in another order) can flip one FP8 rounding and move the logits by
    a quantization step. In fp64 the engine equals full forwards to 1e-12 on every head. In fp32 such flips are
    real and depend on the CPU (measured here: 0 to 2 of 60 cell items, by 2.5e-4 to 8.5e-4, under
    ATEN_CPU_CAPABILITY default, avx2 and avx512), so fp32 is not compared; the engine reports, per cell and
    item, the FP8 roundings and top-k picks within the dtype's rounding of flipping (``last_fragile``)."""
    toks = tokens()
    model = load_v41(ckpts[engram], dtype=torch.float64, index_topk="all", quantize="fp8")
    for q in (20, 21):
        assert check_engine(model, toks, q) <= 1e-12
    model = load_v41(ckpts[engram], dtype=torch.float32, index_topk="all", quantize="fp8")
    eng = V41SuffixEngine(model, toks, 20)
    cells = every_head_cells(len(model.blocks), *eng.clean_z[0].shape[1:])
    eng.run(cells)
    assert eng.last_fragile is not None and eng.last_fragile.shape == (len(cells), N_ITEMS)
    assert eng.last_fragile.dtype == torch.bool and eng.prefix_fragile.shape == (N_ITEMS,)
    assert bool((eng.last_fragile >= eng.prefix_fragile).all())  # a fragile prefix makes every cell of the item fragile


@pytest.mark.parametrize("weights", ["dequantized", "packed"])
def test_binding_top_k_and_small_passes(ckpts, weights):
    """index_topk=6 binds at these lengths (the picks and the candidate filter are recomputed from the intervened
    rows at every index source at or above the cell's layer); passes of 7 rows split cells across passes."""
    model = load_v41(ckpts[True], dtype=torch.float64, weights=weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        assert check_engine(model, tokens(seed=3), 25, rows_per_pass=7) <= TOL
    assert model.analysis_metadata["index_topk_binding"] is True


def test_chunked_prefix_and_rows_with_different_slots(ckpts):
    """A model loaded with chunk=4 prefills the prefix in pieces (its hooks see the query piece only, so the
    reference is the unchunked model's forward); rows with different query slots are grouped
    by slot (model.query_engine) and come back in the items' order."""
    chunked = load_v41(ckpts[True], dtype=torch.float64, index_topk="all", chunk=4)
    model = load_v41(ckpts[True], dtype=torch.float64, index_topk="all")  # the reference: one parallel forward
    toks = tokens(seed=5)
    qp = torch.tensor([17, 22, 17])
    eng = chunked.query_engine(toks, qp)
    g = torch.Generator().manual_seed(2)
    cells = [Cell(3, [1], torch.randn(1, 64, generator=g, dtype=torch.float64)), Cell(5, [0, 2], None)]
    out = eng.run(cells)
    rows = torch.arange(N_ITEMS)
    for cell, got in zip(cells, out):
        def write(z, hook, cell=cell):
            z = z.clone()
            r = torch.zeros(len(cell.heads), z.shape[-1]) if cell.replacement is None else cell.replacement
            z[rows[:, None], qp[:, None], torch.tensor(cell.heads)[None]] = r.to(z.dtype)
            return z

        with torch.no_grad():
            ref = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{cell.layer}.attn.hook_z", write)])[rows, qp]
        assert (ref - got).abs().max() <= TOL
    with torch.no_grad():
        assert (model(toks)[rows, qp] - eng.clean_logits).abs().max() <= TOL


def test_active_hooks_are_refused(ckpts):
    model = load_v41(ckpts[False], dtype=torch.float32, index_topk="all")
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: None)]):
        with pytest.raises(InputError, match="engine='full'"):
            model.query_engine(tokens(), torch.tensor([20, 20, 20]))


def test_auto_picks_the_engine_and_the_map_equals_full_forwards(ckpts):
    """engine='auto' takes the query-suffix engine on V4.1, and its head map equals the full-forward map."""
    model = phaselens.load(f"hf:{ckpts[True]}", dtype=torch.float64, index_topk="all")
    from tests.support.models import tiny_task

    task = tiny_task()
    kw = dict(method="zero", n_per_residue=1, kinds=("head",), progress=False, n_bootstrap=20, seed=0)
    auto = phaselens.specialization_map(model, task, **kw)
    full = phaselens.specialization_map(model, task, engine="full", **kw)
    assert auto.metadata["engine"] == "suffix" and full.metadata["engine"] == "full"
    rm = auto.metadata["rounding_margins"]  # measured by the engine; full forwards do not measure them
    assert rm["cells"] == 28 and rm["items"] == task.modulus and 0 <= rm["cells_fragile"] <= rm["cells"]
    assert rm["relative_rounding"] == 2 * torch.finfo(torch.float64).eps
    assert full.metadata["rounding_margins"] is None
    a, f = auto.to_frame(), full.to_frame()
    assert len(a) == 7 * 4 * task.modulus  # layers x heads x residues (the task's modulus; phases 0 and 1)
    # fp64 logits, scored in fp32 (scoring.answer_metrics): equal to fp32 rounding
    np.testing.assert_allclose(a["delta_logit_diff"].to_numpy(), f["delta_logit_diff"].to_numpy(), rtol=0, atol=1e-6)
    assert a["delta_logit_diff"].abs().max() > 1e-3


def test_the_map_counts_cells_whose_fp8_roundings_are_within_rounding_of_a_flip(ckpts):
    """In fp32 with quantize='fp8' every row rounds thousands of values to FP8, and some land within two units
    in the last place of a rounding midpoint: the map's metadata counts those cells (in fp64 none)."""
    from tests.support.models import tiny_task

    task = tiny_task()
    kw = dict(method="zero", n_per_residue=1, kinds=("layer",), progress=False, n_bootstrap=10, seed=0)
    counts = {}
    for dtype in (torch.float32, torch.float64):
        model = phaselens.load(f"hf:{ckpts[False]}", dtype=dtype, index_topk="all", quantize="fp8")
        counts[dtype] = phaselens.specialization_map(model, task, **kw).metadata["rounding_margins"]
    assert counts[torch.float32]["cells"] == 7 and counts[torch.float32]["cells_fragile"] >= 1
    assert counts[torch.float64]["cells_fragile"] == 0
