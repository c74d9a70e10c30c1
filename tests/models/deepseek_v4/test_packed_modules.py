"""The DeepSeek-V4 adapter on transformers' packed FP8 / FP4 modules (what ``from_pretrained`` builds on CUDA).

On the CPU: the real ``FP8Linear`` / ``FP8GroupedLinear`` / ``FP8Experts`` modules from transformers' own
quantizer, holding FP8 block codes and FP4 expert codes, with the GPU kernels replaced by CPU stand-ins
(``tests/support/deepseek_packed.py``). Every packed tensor records who reads it: only transformers' FP8 modules
themselves (their kernels) and phaselens's decoder (``models/deepseek_v4/packed_modules.py``, which dequantizes with
``models/parts/packed.py``) may.
"""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.contract.memory import MemoryEstimate
from phaselens.models.deepseek_v4.memory import estimate_memory
from phaselens.models.deepseek_v4.packed_modules import dense_weight, is_packed
from tests.support.deepseek import one_thread  # noqa: F401  (single-thread fixture)
from tests.support.deepseek_packed import Watched, cpu_kernels, packed_tiny_v4
from tests.support.paths import ROOT

# transformers' FP8 modules (their kernels), and phaselens's decoder (V4's bridge and the shared dequantizer)
ALLOWED = ("transformers/integrations/finegrained_fp8.py", "phaselens/models/deepseek_v4/packed_modules.py",
           "phaselens/models/parts/packed.py")


def _x(seed=0):
    return torch.randint(0, 1000, (2, 37), generator=torch.Generator().manual_seed(seed))


def _readers() -> set[str]:
    return {f for _, f in Watched.reads if not f.endswith(ALLOWED)}


def same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what) -> None:
    """The packed model equals its dense twin up to the order of fp32 sums: the grouped stand-in kernel is a
    ``bmm`` where the dense twin runs its own GEMMs, and the two may sum in another order on another CPU. In fp32
    to 1e-5 of the values' scale; in bf16, where such a difference can move an output by one unit in the last
    place, within 1e-3 mean-relative (the bf16 floor of docs/deepseek_v4.md is 6.8e-4 to 1.2e-3); measured
    bit-identical on two CPUs."""
    a, b = a.double(), b.double()
    scale = a.abs().mean()
    if dtype == torch.float32:
        assert (a - b).abs().max() <= 1e-5 * scale, what
    else:
        assert (a - b).abs().mean() <= 1e-3 * scale and (a - b).abs().max() <= 0.1 * a.abs().max(), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_on_packed_modules_matches_dense_weights_and_never_reads_them(dtype):
    """Logits, hooked activations and a knockout equal the dense twin's under numerics 'reference' and
    'transformers' and quantize None / 'fp8'; no code outside the FP8 modules and phaselens's decoder touches
    a packed tensor. (bf16 is where numerics='reference' recomputes the compressors' kv_proj / gate_proj,
    packed here, in fp32.)"""
    dense, packed = packed_tiny_v4(0, dtype=dtype)
    assert is_packed(packed.model.layers[1].self_attn.compressor.kv_proj)
    assert type(packed.model.layers[1].mlp.experts).__name__.endswith("FP8Experts")
    Watched.reads.clear()
    names = ["blocks.1.attn.hook_z", "blocks.1.attn.hook_gate", "blocks.3.hook_resid_post"]
    ko = [("blocks.3.attn.hook_z", lambda z, hook: z.index_fill(2, torch.tensor([1]), 0.0))]
    with torch.no_grad(), cpu_kernels() as calls:
        for numerics in ("reference", "transformers"):
            for quantize in (None, "fp8"):
                kw = {"numerics": numerics, "quantize": quantize, "index_topk": "all"}
                a, b = phaselens.from_hf(dense, **kw), phaselens.from_hf(packed, **kw)
                la, ca = a.run_with_cache(_x(), names_filter=names)
                lb, cb = b.run_with_cache(_x(), names_filter=names)
                same(la, lb, dtype, (numerics, quantize))
                for n in names:
                    same(ca[n], cb[n], dtype, n)
                same(a.run_with_hooks(_x(1), fwd_hooks=ko), b.run_with_hooks(_x(1), fwd_hooks=ko), dtype, "ko")
                same(a(_x(2), chunk=8), b(_x(2), chunk=8), dtype, "chunked")  # chunked prefill through the cache
    assert calls["linear"] > 0 and calls["grouped"] > 0  # the packed modules ran their (stand-in) kernels
    assert Watched.reads and not _readers(), sorted(_readers())


def test_decoder_and_memory_estimate_on_packed_modules():
    dense, packed = packed_tiny_v4(1)
    for name in ("model.layers.1.self_attn.q_b_proj", "model.layers.2.self_attn.compressor.gate_proj"):
        p, d = packed.get_submodule(name), dense.get_submodule(name)
        assert is_packed(p) and not is_packed(d)
        assert torch.equal(dense_weight(p, torch.float32), d.weight)
    e_packed = estimate_memory(phaselens.from_hf(packed, chunk=8), 64, chunk=8)
    e_dense = estimate_memory(phaselens.from_hf(dense, chunk=8), 64, chunk=8)
    assert type(e_packed) is MemoryEstimate and e_packed.activations == 0  # the contract's type; V4 counts no other transients
    assert e_packed.cache == e_dense.cache and e_packed.attention == e_dense.attention
    assert e_packed.weights < e_dense.weights  # FP8 / FP4 bytes


def test_gpu_check_script_exists_and_prints_json():
    script = ROOT / "tests" / "gpu" / "packed.py"
    assert script.is_file() and "json" in script.read_text()
