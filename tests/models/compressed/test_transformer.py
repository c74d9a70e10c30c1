"""CompressedTransformer: causality, entry visibility, pooling, references, cache equality."""

from __future__ import annotations

import json

import pytest
import torch

from phaselens.errors import CacheError, ConfigError, InputError
from phaselens.models import CompressedConfig, CompressorSpec
from tests.support.models import LAYOUTS, make_model
from tests.support.reference import brute_compressed_z, brute_entries, full_attention_reference

T = 29


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 61, (2, T), generator=torch.Generator().manual_seed(0))


def test_causality_changing_token_t_never_changes_earlier_logits(layout, tokens):
    model = make_model(layout)
    base = model(tokens)
    for t in (3, 8, 17):
        other = tokens.clone()
        other[:, t] = (other[:, t] + 7) % 61
        out = model(other)
        assert torch.allclose(out[:, :t], base[:, :t], atol=1e-6)
        assert (out[:, t:] - base[:, t:]).abs().max() > 1e-4  # and later ones do change


def test_token_in_incomplete_window_is_invisible_through_entries():
    # local_window=1: a query sees raw tokens only at itself, so earlier tokens reach it only via entries.
    model = make_model(CompressorSpec(4), local_window=1)
    tokens = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(1))
    base = model(tokens)
    q = 14  # block 3 = slots 12..15 is incomplete at q=14
    same_block = tokens.clone()
    same_block[0, 12] = (same_block[0, 12] + 5) % 61
    assert torch.allclose(model(same_block)[0, q], base[0, q], atol=1e-6)
    assert (model(same_block)[0, 15] - base[0, 15]).abs().max() > 1e-4  # visible once the block completes
    done_block = tokens.clone()
    done_block[0, 9] = (done_block[0, 9] + 5) % 61  # block 2 (8..11) is complete at q
    assert (model(done_block)[0, q] - base[0, q]).abs().max() > 1e-4


def test_pattern_hooks_put_no_mass_on_incomplete_entries(layout, tokens):
    model = make_model(layout)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "hook_pattern" in n)
    S = layout.stride
    for layer in range(2):
        entry = cache[f"blocks.{layer}.attn.hook_pattern_entry"]  # [B, H, T, E]
        local = cache[f"blocks.{layer}.attn.hook_pattern_local"]
        sink = cache[f"blocks.{layer}.attn.hook_pattern_sink"]
        assert entry.shape == (2, 4, T, T // S) and local.shape == (2, 4, T, 5) and sink.shape == (2, 4, T)
        visible = (torch.arange(T)[:, None] + 1) // S > torch.arange(T // S)[None, :]
        assert entry[..., ~visible].abs().max() == 0
        assert entry[..., visible].min() > 0
        total = entry.sum(-1) + local.sum(-1) + sink
        assert torch.allclose(total, torch.ones_like(total), atol=1e-5)


def test_uniform_gates_give_the_arithmetic_mean():
    spec = CompressorSpec(3, 6, gate="uniform", position_bias=False, rope="none")
    model = make_model(spec)
    tokens = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(2))
    _, cache = model.run_with_cache(tokens)
    attn = model.blocks[1].attn
    h = model.blocks[1].ln1(cache["blocks.1.hook_resid_pre"])
    payload = h @ attn.compressor.poolers["k"].payload.weight[0, 0]  # [B, T, Hkv*d]
    entries = cache["blocks.1.attn.hook_entry_k"].flatten(-2)  # [B, E, Hkv*d]
    for j in range(20 // 3):
        lo = max(0, 3 * j + 3 - 6)
        assert torch.allclose(entries[:, j], payload[:, lo : 3 * j + 3].mean(1), atol=1e-6)
    gates = cache["blocks.1.attn.hook_gate_k"]  # [B, E, W, Hkv]
    assert torch.allclose(gates[:, 0, :3], torch.zeros(1)) and torch.allclose(gates[:, 0, 3:], torch.tensor(1 / 3))
    assert torch.allclose(gates[:, 1:], torch.tensor(1 / 6))


def test_full_attention_control_equals_transformers_eager_sink_attention(tokens):
    for sink in (True, False):
        model = make_model(None, sink=sink)
        assert all(b.attn.kind == "full" for b in model.blocks)
        ref = full_attention_reference(model, tokens)
        assert torch.allclose(model(tokens), ref, atol=1e-5)


def test_compressed_layers_match_brute_force_loops(layout, tokens):
    model = make_model(layout)
    _, cache = model.run_with_cache(tokens)
    for layer in range(2):
        attn = model.blocks[layer].attn
        h = attn_input = model.blocks[layer].ln1(cache[f"blocks.{layer}.hook_resid_pre"])
        for path in attn.compressor.paths:
            name = "hook_entry" if path == "kv" else f"hook_entry_{path}"
            assert torch.allclose(cache[f"blocks.{layer}.attn.{name}"], brute_entries(attn, h, path), atol=1e-5)
        assert torch.allclose(cache[f"blocks.{layer}.attn.hook_z"], brute_compressed_z(attn, attn_input), atol=1e-5)


@pytest.mark.parametrize("chunks", [[1] * 29, [5, 1, 1, 9, 2, 11], [29]])
def test_incremental_decoding_equals_parallel_forward(layout, tokens, chunks):
    model = make_model(layout)
    full = model(tokens)
    cache = model.new_cache(2, 64)
    outs, i = [], 0
    for n in chunks:
        outs.append(model(tokens[:, i : i + n], cache=cache))
        i += n
    assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5
    assert cache.length == T


def test_mixed_layers_and_sliding_only_layers_decode_exactly(tokens):
    model = make_model(CompressorSpec(4, 8, overlap_split=True), n_layers=3, compressed_layers=(1,),
                       uncompressed_attention="local")
    assert [b.attn.kind for b in model.blocks] == ["local", "compressed", "local"]
    full = model(tokens)
    cache = model.new_cache(2, T)
    steps = torch.cat([model(tokens[:, i : i + 1], cache=cache) for i in range(T)], 1)
    assert (steps - full).abs().max() <= 1e-5


def test_generate_matches_greedy_argmax_of_parallel_forward():
    # fp64: cached decoding and the parallel forward sum in different orders; in fp32 a near-tie between the two
    # best logits could pick another token on some CPU
    model = make_model(LAYOUTS["w8s4-deepseek"]).double()
    prompt = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, 6, prefill_chunk=4)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


def _expected_cache_bytes(model, length: int) -> int:
    cfg, comp = model.config, model.config.compression
    row = cfg.n_key_value_heads * cfg.d_head * 4  # fp32 bytes of one KV row
    S, k = comp.stride, comp.window // comp.stride
    paths = 1 if comp.tied_kv else 2
    entries = (length // S) * row * paths
    raw = min(length, cfg.local_window - 1) * row * paths
    grouped = comp.overlap_split
    gate_ch = {"scalar": cfg.n_key_value_heads, "vector": row // 4, "uniform": 0}[comp.gate]
    pay_groups = k if grouped or comp.payload == "per_offset" else 1
    gate_groups = k if grouped or comp.gate_params == "per_offset" else 1
    # The open stride block holds every group of its tokens' projections; the k-1 blocks before it keep
    # only the groups later entries read (one shared group, or k-1 of them: DeepSeek's previous-block Ca half).
    open_block = S * (pay_groups * row + gate_groups * gate_ch * 4)
    prev = (k - 1) * S * ((1 if pay_groups == 1 else k - 1) * row
                          + (1 if gate_groups == 1 else k - 1) * gate_ch * 4 * (gate_ch > 0))
    return cfg.n_layers * (entries + raw + paths * (open_block + prev))


@pytest.mark.parametrize("length", [3, 17, 64])
def test_cache_nbytes_sums_real_storage_and_matches_layout(layout, length):
    model = make_model(layout)
    cache = model.new_cache(1, 64)
    model(torch.randint(0, 61, (1, length)), cache=cache)
    assert cache.nbytes() == _expected_cache_bytes(model, length)
    assert cache.reserved_nbytes() >= cache.nbytes()


def test_deepseek_layout_keeps_only_previous_block_half():
    model = make_model(LAYOUTS["w8s4-deepseek"])
    cache = model.new_cache(1, 32)
    model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
    layout = cache.layout()[1]
    assert layout["open_kv_payload"] == (1, 2, 4, 16)  # [B, groups Ca|Cb, S, Hkv*d]
    assert layout["prev_kv_payload"] == (1, 1, 1, 4, 16)  # previous block: Ca half only
    assert layout["entries_kv"] == (1, 2, 2, 8) and layout["raw_k"] == (1, 4, 2, 8)


def test_cache_errors_are_clear():
    model = make_model(CompressorSpec(4))
    cache = model.new_cache(2, 8)
    with pytest.raises(CacheError, match="batch 1"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    model(torch.zeros(2, 6, dtype=torch.long), cache=cache)
    with pytest.raises(CacheError, match="exceed max_len=8"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(CacheError, match="n_ctx"):
        model.new_cache(1, 10_000)


def test_cache_refuses_reuse_after_an_error_mid_forward():
    model = make_model(CompressorSpec(4))
    cache = model.new_cache(1, 16)

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        model.run_with_hooks(torch.zeros(1, 3, dtype=torch.long), cache=cache, fwd_hooks=[("blocks.1.hook_resid_pre", boom)])
    with pytest.raises(CacheError, match="half-updated"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    cache.reset()
    model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


@pytest.mark.parametrize(
    "tokens, match",
    [
        (torch.tensor([[0, 61]]), "0..60"),
        (torch.zeros(1, 3), "integer ids"),
        (torch.zeros(1, 300, dtype=torch.long), "n_ctx=256"),
    ],
)
def test_bad_tokens_raise_input_error(tokens, match):
    with pytest.raises(InputError, match=match):
        make_model(CompressorSpec(4))(tokens)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(compressed_layers=(5,)), "outside 0..1"),
        (dict(rope=None, compression=CompressorSpec(4, 8, overlap_split=True, tied_kv=True,
                                                    rope=__import__("phaselens.models", fromlist=["RopeSpec"]).RopeSpec())), "tied K=V"),
    ],
)
def test_bad_configs_raise_config_error(kwargs, match):
    base = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=61, n_ctx=64,
                compression=CompressorSpec(4))
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        CompressedConfig(**base)


def test_device_is_a_string_or_a_torch_device():
    base = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=61, n_ctx=64)
    assert CompressedConfig(**base, device=torch.device("cpu")).device == "cpu"
    assert CompressedConfig(**base, device="cpu").device == "cpu"
    assert make_model(device=torch.device("cpu")).cfg.device == "cpu"


def test_compressor_spec_errors():
    with pytest.raises(ConfigError, match="overlap_split needs overlapping windows"):
        CompressorSpec(4, overlap_split=True)
    with pytest.raises(ConfigError, match="uniform gates have no parameters"):
        CompressorSpec(4, gate="uniform")


def test_config_json_round_trip_and_unknown_key(layout):
    cfg = make_model(layout).config
    assert CompressedConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    bad = cfg.to_dict() | {"n_experts": 3}
    with pytest.raises(ConfigError, match="n_experts"):
        CompressedConfig.from_dict(bad)


def test_gate_hooks_sit_on_the_real_computation(tokens):
    model = make_model(LAYOUTS["w4s4-scalar"])
    base = model(tokens)

    def flatten_gates(alpha, hook):
        return torch.full_like(alpha, 1 / alpha.shape[2])

    out = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_gate_k", flatten_gates)])
    assert (out - base).abs().max() > 1e-4
    assert not model.blocks[0].attn.hook_gate_k._forward_hooks  # removed afterwards


def test_repr_is_informative():
    text = repr(make_model(LAYOUTS["w8s4-deepseek"]))
    assert "S=4 W=8" in text and "tied K=V" in text and "params" in text


def test_float64_decoding_is_exact_and_fp32_differs_only_by_rounding(tokens):
    """The cached path and the parallel forward compute the same function: in float64 they agree to 1e-12,
    so the fp32 differences (up to ~1e-5) are summation-order rounding between different kernel shapes."""
    model = make_model(LAYOUTS["w8s4-deepseek"]).double()
    cache = model.new_cache(2, T)
    with torch.no_grad():
        steps = torch.cat([model(tokens[:, i : i + 1], cache=cache) for i in range(T)], 1)
        assert (steps - model(tokens)).abs().max() < 1e-12
