"""The released DeepSeek-V4 configs (Flash, Pro) on the meta device: geometry, hook table, sizes and memory.

The configs are the public ``config.json`` facts in ``tests/support/deepseek.py``; nothing is downloaded and no weight
is allocated. Independent references: the configs' own ``compress_ratios`` (0 sliding, 4 CSA, 128 HCA), the
published parameter counts (Flash 284B, Pro 1.6T) and KV cache size (Pro, 1M tokens, bf16: 9.62 GiB), and
hand arithmetic.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from phaselens.contract.memory import GiB
from phaselens.core.geometry import PhaseSpec
from phaselens.models.deepseek_v4 import LayerTypesWarning, from_transformers, load_hf
from phaselens.models.deepseek_v4.memory import estimate_memory
from phaselens.models.deepseek_v4.prefill import call_kwargs, run_prefix
from phaselens.models.parts.chunks import plan_chunks
from tests.support.deepseek import (
    FLASH_CONFIG,
    PRO_CONFIG,
    attention_modules,
    meta_v4,
    one_thread,  # noqa: F401  (fixture)
    random_tokens,
    released_config,
    run_capturing,
    tiny_v4_bf16,
    tiny_v4_model,
)
from tests.support.deepseek_reference import yarn_inv_freq

RELEASED = {"flash": FLASH_CONFIG, "pro": PRO_CONFIG}
SPEC = {0: None, 4: PhaseSpec(4, 8), 128: PhaseSpec(128)}


@pytest.fixture(scope="module", params=["flash", "pro"])
def released(request):
    facts = RELEASED[request.param]
    return request.param, facts, meta_v4(facts)


def test_geometry_follows_compress_ratios(released):
    name, facts, model = released
    adapter = from_transformers(model)
    n = facts["num_hidden_layers"]
    ratios = facts["compress_ratios"][:n]  # the last entry is the MTP layer's
    assert adapter.phase_specs == [SPEC[r] for r in ratios]
    kinds = [g.kind for g in adapter.layer_geometry]
    if name == "flash":  # layers 0-1 sliding, CSA on even 2-42, HCA on odd 3-41
        assert kinds[:2] == ["sliding"] * 2
        assert [i for i, k in enumerate(kinds) if k == "csa"] == list(range(2, 43, 2))
        assert [i for i, k in enumerate(kinds) if k == "hca"] == list(range(3, 42, 2))
    else:  # HCA at 0-1, then CSA on even and HCA on odd layers to 60, no sliding-only layer
        assert [i for i, k in enumerate(kinds) if k == "hca"] == [0, 1, *range(3, 60, 2)]
        assert [i for i, k in enumerate(kinds) if k == "csa"] == list(range(2, 61, 2))
    assert adapter.analysis_stride == 4 and adapter.analysis_spec == PhaseSpec(4)
    cfg = adapter.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_model) == (
        n, facts["num_attention_heads"], 512, facts["hidden_size"]
    )
    assert (cfg.rope_dims, cfg.local_window, cfg.hc_mult, cfg.index_topk, cfg.o_groups) == (
        64, 128, 4, facts["index_topk"], facts["o_groups"]
    )
    assert cfg.dtype == torch.bfloat16 and cfg.device.type == "meta"
    md = adapter.analysis_metadata
    changes = md["numerics_changes"]  # the shared expert, then the bf16 rounding (3 lines); no RoPE change
    assert md["numerics"] == "reference" and len(changes) == 4 and "shared experts" in changes[0]
    assert not any("RoPE (YaRN" in c for c in changes)


def test_the_compressed_rope_is_the_reference_yarn():
    """θ 160000, YaRN factor 16 from 65,536 on 64 dims, attention_factor 1 (from the flat rope_scaling)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    for facts in RELEASED.values():
        rotary = DeepseekV4RotaryEmbedding(released_config(facts))  # small: built for real, on the CPU
        assert rotary.compress_attention_scaling == 1.0 and rotary.main_attention_scaling == 1.0
        assert torch.allclose(rotary.compress_inv_freq.double(), yarn_inv_freq(64), rtol=1e-6, atol=0)
        plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
        assert torch.allclose(rotary.main_inv_freq.double(), plain, rtol=1e-6, atol=0)


def test_hook_table(released):
    name, facts, model = released
    points = from_transformers(model).hook_dict
    n = facts["num_hidden_layers"]
    ratios = facts["compress_ratios"][:n]
    compressed, csa = sum(r > 0 for r in ratios), sum(r == 4 for r in ratios)
    # hook_embed, 10 sites on every layer, 4 on compressed layers (gate, payload, entry, pattern_entry),
    # the indexer's picks on CSA layers
    assert len(points) == 1 + 10 * n + 4 * compressed + csa == {"flash": 616, "pro": 885}[name]
    for layer, r in enumerate(ratios):
        assert (f"blocks.{layer}.attn.hook_entry" in points) == (r > 0)
        assert (f"blocks.{layer}.attn.hook_indexer_topk" in points) == (r == 4)
        assert f"blocks.{layer}.attn.hook_z" in points and f"blocks.{layer}.hook_resid_post" in points
    assert points["blocks.2.attn.hook_gate"].shape == "[B, E_new, W, 1, d]"
    assert list(points)[-1] == f"blocks.{n - 1}.hook_resid_post"


def test_parameter_counts_are_the_published_ones(released):
    name, _, model = released
    n = sum(p.numel() for p in model.parameters())
    if name == "flash":
        assert round(n / 1e9) == 284  # "284B total parameters"
    else:
        assert round(n / 1e12, 1) == 1.6  # "1.6T total parameters"


def test_memory_estimates_on_the_released_sizes(released):
    name, facts, model = released
    L, H, S = 128, facts["num_attention_heads"], 4
    if name == "pro":
        est = estimate_memory(model, 2**20, chunk=4096)
        # published: a 1M-token context's KV cache is 9.62 GiB per sequence in bf16. Here: entries
        # (30 CSA x 2**18 rows + 31 HCA x 2**13 rows of 512), indexer keys (30 x 2**18 of 128), windows
        # (61 x 127 rows of 512), bf16; plus the compressors' fp32 overlap halves (a few KiB).
        by_hand = 2 * (30 * 2**18 * 512 + 31 * 2**13 * 512 + 30 * 2**18 * 128 + 61 * 127 * 512)
        assert by_hand <= est.cache <= by_hand + 2**20
        assert abs(est.cache / GiB - 9.62) < 0.01  # measured 9.625
        return
    # Flash in bf16 (docs/deepseek_v4.md): the largest attention probabilities [B, H, n, raw + entries]
    from_transformers(model)  # numerics="reference": the head computes fp32 logits
    T = 8192
    assert estimate_memory(model, T).attention == H * T * (T + T // S) * 2 == 10 * GiB
    chunked = estimate_memory(model, T, chunk=512)
    assert chunked.attention == H * 512 * (L - 1 + 512 + T // S) * 2  # 168 MiB
    assert round(estimate_memory(model, 2**17, chunk=512).attention / GiB, 1) == 2.0
    assert estimate_memory(model, 2**17, chunk=512, logits="query").logits == 512 * 129280 * 4
    from_transformers(model, numerics="transformers")
    assert estimate_memory(model, 2**17, chunk=512, logits="query").logits == 512 * 129280 * 2
    fp32 = meta_v4(facts, torch.float32)
    assert estimate_memory(fp32, 2**17).logits == 129280 * 2**17 * 4  # 67.8 GB: why logits="query"
    assert estimate_memory(model, T).cache == 0  # one uncached call keeps no cache


# ---- the estimates against real tensors on the tiny model ----------------------------------------------
def _cache_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for slot in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
            tensors += list(getattr(layer, slot, {}).values())
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("T, chunk", [(37, 8), (64, 16), (101, 20), (5, 2)])
def test_cache_estimate_is_the_real_cache(tmp_path, dtype, T, chunk):
    model = tiny_v4_model() if dtype == "fp32" else tiny_v4_bf16(tmp_path)  # bf16: fp32 projections
    adapter = from_transformers(model, index_topk="all")
    tokens = random_tokens(2, T, 0)
    plan = plan_chunks(T, chunk, None)
    prefix = run_prefix(model, tokens, plan, keep_logits=False)
    with torch.no_grad():
        model(**call_kwargs(tokens[:, plan.query_start :], plan.query_start, prefix.cache))
    assert estimate_memory(adapter, T, batch=2, chunk=chunk).cache == _cache_bytes(prefix.cache)


@pytest.mark.parametrize("T, chunk", [(48, None), (80, 16), (75, 32)])
def test_attention_estimate_is_the_largest_probability_tensor(T, chunk):
    adapter = from_transformers(tiny_v4_model(), index_topk="all")
    tokens = random_tokens(1, T, 1)
    plan = plan_chunks(T, chunk, None)
    largest = 0
    if plan.prefix:  # the prefix pieces are not hooked by the adapter: measure them on the model directly
        modules = attention_modules(adapter)
        handles = [m.register_forward_hook(lambda _m, _a, out: sizes.append(out[1].nbytes)) for m in
                   modules.values()]
        sizes: list[int] = []
        try:
            run_prefix(adapter.model, tokens, plan, keep_logits=False)
        finally:
            for h in handles:
                h.remove()
        largest = max(sizes)
    _, calls = run_capturing(adapter, tokens, attention_modules(adapter), keep=lambda a, out: out[1].nbytes,
                             chunk=chunk)
    largest = max(largest, *(size for sizes_ in calls.values() for size in sizes_))
    assert estimate_memory(adapter, T, chunk=chunk).attention == largest


def test_weights_estimate_is_the_checkpoint_payload(tmp_path):
    model = tiny_v4_model()
    model.save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    header = int.from_bytes(data[:8], "little")
    payload = len(data) - 8 - header  # safetensors: 8-byte header length, JSON header, then the tensors
    unsaved = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                  if n.rsplit(".", 1)[-1] in ("main_inv_freq", "main_original_inv_freq", "compress_inv_freq",
                                               "compress_original_inv_freq"))
    assert estimate_memory(model, 16).weights == payload + unsaved


# ---- loading a checkpoint directory in the released format ---------------------------------------------
def test_a_released_format_directory_loads_without_layer_types(tmp_path):
    """config.json as released: compress_ratios (with the MTP entry), flat rope_scaling, qk_rope_head_dim, no
    layer_types. The weights come from the same small config; only the sizes are shrunk."""
    small = dict(FLASH_CONFIG, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, head_dim=128,
                 qk_rope_head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=2, index_head_dim=64,
                 vocab_size=512, compress_ratios=[0, 0, 4, 128, 4, 0])
    small.pop("quantization_config")  # plain weights here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import DeepseekV4ForCausalLM

        DeepseekV4ForCausalLM(released_config(small)).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small))  # as released: no layer_types
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerTypesWarning)
        adapter = load_hf(tmp_path, dtype=torch.bfloat16, quantize="fp8", index_topk="all")
    assert adapter.phase_specs == [None, None, PhaseSpec(4, 8), PhaseSpec(128), PhaseSpec(4, 8)]
    md = adapter.analysis_metadata
    assert md["numerics"] == "reference" and md["quantize"] == "fp8" and md["model_modified"]
    rotary = adapter.model.model.rotary_emb
    assert rotary.compress_attention_scaling == 1.0 and math.isclose(rotary.compress_inv_freq[-1].item(),
                                                                      yarn_inv_freq(64)[-1].item(), rel_tol=1e-6)
    assert adapter(random_tokens(1, 20, 2) % 512).shape == (1, 20, 512)
