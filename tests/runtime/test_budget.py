"""Every run priced before it allocates (``phaselens.runtime.budget``): the items and one forward against the
memory there is, and the price of building items against a measured build."""

from __future__ import annotations

import pytest

import phaselens
from phaselens.tasks import KVRecall

V4_TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)


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
    with pytest.raises(phaselens.errors.ResourceError, match=r"need about .* GiB of memory to build") as info:
        phaselens.evaluate(model, n_per_residue=1000, progress=False)
    fits = int(re.search(r"use n_per_residue=([\d,]+) or fewer", str(info.value))[1].replace(",", ""))
    T, M = task.seq_len(model.analysis_spec), task.modulus
    assert budget.items_bytes(M * fits, T) <= 10 * 2**20 < budget.items_bytes(M * (fits + 1), T)
    monkeypatch.setattr(type(task), "build", real_build)
    monkeypatch.setattr(budget, "host_available", lambda: 10 * 2**20 + budget.items_bytes(M * fits, T) // 100)
    with pytest.raises(phaselens.errors.ResourceError, match="a forward of batch_size=48"):  # the items fit, one forward not
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
