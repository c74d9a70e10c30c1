"""Every constructor that allocates from a size a user gives prices it first (issue "Reliability round 4", class 1).

The class: a model built from its config, ``model.new_cache(batch_size, max_len)``, one forward of the tokens
given, and a task's items (``block_filler``, ``n_per_residue``, a training ``batch_size``). A size beyond the
memory raises :class:`~phaselens.errors.ResourceError` at once (well under a second, no large allocation), and the
message names the largest size that fits, which the price itself confirms (that size fits, one more does not).
The prices are exact where they can be (weights and caches equal what the built objects hold).
"""

from __future__ import annotations

import re
import resource
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import phaselens
from phaselens.core.geometry import PhaseSpec
from phaselens.models import CompressedConfig, CompressedTransformer, CompressorSpec
from phaselens.models.compressed import sizing
from phaselens.runtime import budget
from phaselens.tasks import KVRecall, placement
from tests.support.models import LAYOUTS

GiB = 2**30
SMALL_CFG = dict(n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=256, d_vocab=128, n_ctx=10**9,
                 local_window=8, compression=CompressorSpec(4))
HUGE = 2**60  # bytes no machine has
ZOO = phaselens.load("zoo:w4s4")


def _number(text: str, name: str) -> int:
    """The first ``name=N`` of the message's last clause (what fits; the request is named before it)."""
    found = re.search(rf"{name}=([\d,]+)", text.rsplit(";", 1)[-1])
    assert found, f"the message names no {name}=...: {text}"
    return int(found[1].replace(",", ""))


def refused_quickly(make: Callable[[], Any]) -> phaselens.errors.ResourceError:
    """``make()`` raises ResourceError in well under a second without growing the process's peak memory."""
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    with pytest.raises(phaselens.errors.ResourceError) as info:
        make()
    assert time.perf_counter() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0 < 256 * 1024  # < 256 MiB: nothing was built
    return info.value


@pytest.fixture
def small_host(monkeypatch):
    """A host with 1 GiB available (and 1 GiB of machine memory for task builds)."""
    monkeypatch.setattr(budget, "host_available", lambda: GiB)
    monkeypatch.setattr(placement, "machine_memory", lambda: GiB)
    return GiB


@pytest.fixture(scope="module")
def zoo():
    return ZOO


# ---- the class: a size beyond the machine's memory is refused at once ---------------------------------------
def _model(**sizes: int) -> Callable[[], Any]:
    return lambda: CompressedTransformer(CompressedConfig(**{**SMALL_CFG, **sizes}))


BEYOND_MEMORY = {
    "model d_model=10**9": _model(d_model=10**9),
    "model d_vocab=10**12": _model(d_vocab=10**12),
    "model n_layers=10**9": _model(n_layers=10**9),
    "model d_mlp=10**11": _model(d_mlp=10**11),
    "new_cache batch=10**9": lambda: ZOO.new_cache(10**9),
    "new_cache max_len=n_ctx=10**12": lambda: CompressedTransformer(
        CompressedConfig(**{**SMALL_CFG, "n_ctx": 10**12, "compression": None})).new_cache(),
    "forward of 4 x 10**6 tokens": lambda: CompressedTransformer(
        CompressedConfig(**{**SMALL_CFG, "compression": None})).forward(torch.zeros(4, 10**6, dtype=torch.long)),
    "KVRecall block_filler=10**9": lambda: KVRecall(block_filler=10**9).build(PhaseSpec(4), n_per_residue=1),
    "KVRecall n_per_residue=10**12": lambda: KVRecall().build(PhaseSpec(4), n_per_residue=10**12),
    "KVRecall training block_filler=10**9": lambda: KVRecall(block_filler=10**9).sample_training_batch(8),
}


@pytest.mark.parametrize("name", list(BEYOND_MEMORY))
def test_a_size_beyond_the_machine_is_refused_before_it_is_allocated(name):
    err = refused_quickly(BEYOND_MEMORY[name])
    text = str(err)
    assert re.search(r"needs? about [\d.,e+]+ [GT]iB", text), text
    assert re.search(r"(d_model|d_vocab|n_layers|d_mlp|batch_size|max_len|tokens|block_filler|n_per_residue)"
                     r"=?[\d,]+", text.split(";", 1)[1]), text  # after the price: what fits


# ---- the named size is the largest that fits ----------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("d_model", 10**6), ("d_vocab", 10**8), ("n_layers", 10**6), ("d_mlp", 10**8)])
def test_a_model_refusal_names_the_largest_size_that_fits(small_host, field, value):
    cfg = CompressedConfig(**{**SMALL_CFG, field: value})
    text = str(refused_quickly(lambda: CompressedTransformer(cfg)))
    fits = _number(text, field)
    need = lambda x: sum(sizing.weight_bytes(cfg, **{field: x}).values())  # noqa: E731
    assert need(fits) <= small_host < need(fits + 1)  # the price is the allocation (see the last tests)


def test_a_cache_refusal_names_the_largest_batch_and_length_that_fit(small_host, zoo):
    text = str(refused_quickly(lambda: zoo.new_cache(batch_size=10**5, max_len=200)))
    b = _number(text, "batch_size")
    assert sizing.cache_bytes(zoo, b, 200) <= small_host < sizing.cache_bytes(zoo, b + 1, 200)
    model = CompressedTransformer(CompressedConfig(**SMALL_CFG))
    text = str(refused_quickly(lambda: model.new_cache(batch_size=2)))  # max_len = n_ctx = 10**9
    n = int(re.search(r"batch_size=2, max_len=([\d,]+)", text)[1].replace(",", ""))
    assert sizing.cache_bytes(model, 2, n) <= small_host < sizing.cache_bytes(model, 2, n + 1)
    assert model.new_cache(batch=2, max_len=min(n, 4096)).batch_size == 2  # `batch` names batch_size too


def test_a_forward_refusal_names_the_largest_batch_or_length_that_fits(small_host):
    model = CompressedTransformer(CompressedConfig(**{**SMALL_CFG, "compression": None}))
    tokens = torch.zeros(64, 4096, dtype=torch.long)
    text = str(refused_quickly(lambda: model(tokens)))
    b = int(re.search(r"at most ([\d,]+) sequences", text)[1].replace(",", ""))
    need = lambda x: sum(sizing.forward_lower_bound(model, x, 4096, 0, 4096).values())  # noqa: E731
    assert need(b) <= small_host < need(b + 1)
    text = str(refused_quickly(lambda: model(torch.zeros(1, 10**5, dtype=torch.long))))
    assert re.search(r"at most [\d,]+ tokens of one sequence fit", text), text


def test_a_task_refusal_names_the_largest_block_filler_and_count_that_fit(small_host):
    spec = PhaseSpec(4)
    task = KVRecall(block_filler=10**7)
    text = str(refused_quickly(lambda: task.build(spec, n_per_residue=1)))
    bf, n = _number(text, "block_filler"), 24  # 24 residues, one item each
    per = placement.BUILD_BYTES_PER_TOKEN * n
    assert per * KVRecall(block_filler=bf).seq_len(spec) <= small_host < per * KVRecall(block_filler=bf + 1).seq_len(spec)
    text = str(refused_quickly(lambda: KVRecall().build(spec, n_per_residue=10**6)))
    k = _number(text, "n_per_residue")
    T = KVRecall().seq_len(spec)
    assert per * T * k <= small_host < per * T * (k + 1)
    assert len(KVRecall().build(spec, n_per_residue=2)) == 48  # a build that fits is untouched


# ---- the prices are the allocations --------------------------------------------------------------------------
VARIANTS = {
    "plain": {},
    "qwen3-like": dict(qk_norm=True, mlp="swiglu", mlp_bias=False, tie_embeddings=True, sink=False),
    "one compressed layer": dict(compressed_layers=(1,), uncompressed_attention="local"),
    "no rope, mqa": dict(rope=None, n_kv_heads=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", [*LAYOUTS, "control"])
def test_weight_and_cache_prices_equal_what_is_built(layout, variant):
    comp = None if layout == "control" else LAYOUTS[layout]
    cfg = CompressedConfig(n_layers=3, d_model=32, n_heads=4, d_head=8, d_mlp=48, d_vocab=61, n_ctx=64,
                           local_window=5, compression=comp, **VARIANTS[variant])
    model = CompressedTransformer(cfg)
    e = sizing.weight_elements(cfg)
    held = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert e["embed"] + e["blocks"] + e["unembed"] == held
    assert e["largest"] == max(p.numel() for p in model.parameters())
    for batch, max_len in ((1, 1), (3, 40), (2, 64)):
        assert sizing.cache_bytes(model, batch, max_len) == model.new_cache(batch, max_len).reserved_nbytes()


def test_nothing_is_priced_on_the_meta_device(small_host):
    assert budget.available("meta") == (None, "meta")  # size planning builds models there, allocating nothing
    budget.check_allocation("anything", HUGE, device="meta", fits=lambda free: "")
    with pytest.raises(phaselens.errors.ResourceError):
        budget.check_allocation("anything", HUGE, device="cpu", fits=lambda free: "")
