"""``specialization_map(..., plan=True)``: the dry run's counts against a counted run of the same map.

The run is counted at the points where the engines call the model: every scored or calibration forward
(``model_logits`` in scoring, run and knockout), every slot engine's prefill and clean step, every cell pass.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import phaselens
from phaselens.models.compressed.engine import SuffixEngine
from phaselens.models.deepseek_v4.engine import V4SuffixEngine
from phaselens.runtime.planning import MapPlan
from phaselens.tasks import KVRecall
from tests.support.deepseek import one_thread, tiny_v4_model  # noqa: F401  (one_thread: fixture)

V4_TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)


class Counted:
    """Forwards and token passes of a real run (the units of :class:`MapPlan`)."""

    def __init__(self, monkeypatch, model) -> None:
        self.forwards, self.tokens = 0, 0.0
        L, copies = int(model.cfg.n_layers), int(getattr(model, "cost", 1))
        import importlib

        modules = [importlib.import_module(f"phaselens.{m}") for m in ("analyses.scoring", "analyses.knockout_runs",
                                                                         "analyses.knockouts")]

        def forwards(fn):
            def counted(m, tokens, query_pos, fwd_hooks=()):
                self.forwards += 1
                self.tokens += tokens.shape[0] * tokens.shape[1] * copies
                return fn(m, tokens, query_pos, fwd_hooks)
            return counted

        for module in modules:
            monkeypatch.setattr(module, "model_logits", forwards(module.model_logits))
        for cls in (SuffixEngine, V4SuffixEngine):  # the shared SlotEngine's _pass, counted per kind
            init, step = cls.__init__, cls._pass

            def counted_init(eng, m, tokens, q, *a, _init=init, **kw):
                _init(eng, m, tokens, q, *a, **kw)
                self.forwards += (1 if q > 0 else 0) + 1  # prefill, clean step
                self.tokens += tokens.shape[0] * (q + 1)

            def counted_pass(eng, layer, cells, _step=step):
                self.forwards += 1
                self.tokens += len(cells) * eng.n * (L - layer) / L
                return _step(eng, layer, cells)

            monkeypatch.setattr(cls, "__init__", counted_init)
            monkeypatch.setattr(cls, "_pass", counted_pass)


def _v4(chunk=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = phaselens.from_hf(tiny_v4_model(seed=3), chunk=chunk)
    adapter.default_task = V4_TASK
    return adapter


CASES = {
    "zoo-suffix": (lambda: phaselens.load("zoo:w4s4"), dict(method="mean", rows_per_pass=40, batch_size=5)),
    "zoo-full": (lambda: phaselens.load("zoo:w4s4"), dict(method="zero", engine="full", batch_size=7)),
    "ensemble-full": (lambda: phaselens.phase_ensemble(phaselens.load("zoo:w4s4")),
                      dict(method="zero", kinds=("layer",))),
    "v4-chunked-suffix": (lambda: _v4(chunk=8), dict(method="mean", kinds=("head", "layer"), batch_size=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_counts_what_the_map_runs(monkeypatch, case):
    make, opts = CASES[case]
    model = make()
    common = dict(n_per_residue=1, n_bootstrap=0, progress=False, **opts)
    plan = phaselens.specialization_map(model, plan=True, **common)
    assert isinstance(plan, MapPlan)
    counted = Counted(monkeypatch, model)
    pm = phaselens.specialization_map(model, **common)
    assert plan.engine == pm.metadata["engine"]
    assert plan.n_cells == len(pm.cells) and plan.items == len(pm.residue)
    assert plan.forwards == counted.forwards > 2
    assert plan.token_passes == pytest.approx(counted.tokens)
    assert plan.full_forwards == pytest.approx(counted.tokens / (plan.items * plan.tokens))


def test_plan_reads_and_is_frozen():
    plan = phaselens.specialization_map(phaselens.load("zoo:w4s4"), plan=True, n_per_residue=2)
    text = repr(plan)
    for word in ("cells", "forwards", "token passes", "full forwards", "GiB", "engine 'suffix'"):
        assert word in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forwards = 0
    assert plan.memory_bytes == sum(plan.memory.values()) > 0
    with pytest.raises(phaselens.InputError, match="plan"):
        phaselens.specialization_map(phaselens.load("zoo:w4s4"), plan="yes", n_per_residue=1)


def test_plan_of_a_released_size_model_at_128k_needs_no_weights():
    """Flash on the meta device at 128K tokens: the engine's plan is a few full forwards where the full
    engine's is one per cell; memory comes from the adapter's estimate (weights alone are ~530 GiB)."""
    from tests.support.deepseek import FLASH_CONFIG, meta_v4

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = phaselens.from_hf(meta_v4(FLASH_CONFIG), index_topk="all", chunk=1024)
    task = KVRecall(n_records=48, block_filler=65000, n_demos=2, min_distance=8, modulus=8)
    opts = dict(n_per_residue=1, kinds=("layer",), method="zero", batch_size=1)
    fast = phaselens.specialization_map(adapter, task, plan=True, **opts)
    slow = phaselens.specialization_map(adapter, task, plan=True, engine="full", **opts)
    assert fast.tokens > 128_000 and fast.n_cells == 43
    assert fast.engine == "suffix" and slow.engine == "full"
    assert slow.full_forwards == 44  # the clean pass and one per cell
    assert fast.full_forwards < 1.01  # one prefill, then 43 query-row passes
    assert fast.memory["weights"] == slow.memory["weights"] > 500 * 2**30
    # batch_size 1: one cached prefix per item (8 items), each a prefill, a clean step and 43 one-cell passes
    assert fast.memory["cache"] > 0 and fast.forwards == 8 * (1 + 1 + 43)


def test_a_run_is_priced_before_it_allocates(monkeypatch):
    """With 10 MiB free, evaluate refuses before the task builds anything and names the largest n_per_residue
    that fits by the same price; that one runs."""
    import re

    import phaselens.runtime.budget as budget

    model = phaselens.load("zoo:w4s4")
    task = model.default_task
    monkeypatch.setattr(budget, "host_available", lambda: 10 * 2**20)
    real_build = type(task).build

    def boom(*a, **k):
        raise AssertionError("items were built before the run was priced")

    monkeypatch.setattr(type(task), "build", boom)
    with pytest.raises(phaselens.ResourceError, match=r"need about .* GiB of memory to build") as info:
        phaselens.evaluate(model, n_per_residue=1000, progress=False)
    fits = int(re.search(r"use n_per_residue=([\d,]+) or fewer", str(info.value))[1].replace(",", ""))
    T, M = task.seq_len(model.analysis_spec), task.modulus
    assert budget.items_bytes(M * fits, T) <= 10 * 2**20 < budget.items_bytes(M * (fits + 1), T)
    monkeypatch.setattr(type(task), "build", real_build)
    monkeypatch.setattr(budget, "host_available", lambda: 10 * 2**20 + budget.items_bytes(M * fits, T) // 100)
    with pytest.raises(phaselens.ResourceError, match="a forward of batch_size=48"):  # the items fit, one forward not
        phaselens.evaluate(model, n_per_residue=2, progress=False)


def test_the_price_of_building_items_is_an_upper_bound():
    """``BUILD_BYTES_PER_TOKEN``: the peak memory a task's build takes per item token, measured (tracemalloc
    sees numpy's and pandas' buffers; torch's tensors come from numpy here) at 45-53 bytes; 56 bounds it."""
    import tracemalloc

    from phaselens.runtime.budget import items_bytes

    task = V4_TASK
    tracemalloc.start()
    batch = task.build(phaselens.PhaseSpec(4), n_per_residue=500, seed=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    n, T = batch.tokens.shape
    assert peak <= items_bytes(n, T), (peak / (n * T), items_bytes(n, T) / (n * T))
