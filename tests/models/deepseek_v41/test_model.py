"""DeepSeek-V4.1: loading, geometry, the sharing map, the cache, visibility and the hooks (tiny checkpoints)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import phaselens
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import CheckpointError, InputError, UnsupportedModelError
from phaselens.models.deepseek_v41 import DeepSeekV41, IndexTopKWarning, load_v41
from phaselens.models.deepseek_v41.layers import rope
from tests.support.deepseek_v41 import TINY_TEXT, write_tiny_checkpoint

T = 21


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "tiny-v41")


@pytest.fixture(scope="module")
def model(ckpt):
    return load(ckpt)


@pytest.fixture(scope="module")
def model_all(ckpt):
    return load(ckpt, index_topk="all")


def load(ckpt, **kw):
    kw.setdefault("dtype", torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        return phaselens.load(f"hf:{ckpt}", **kw)


def tokens(b=2, n=T, seed=0):
    return torch.randint(0, TINY_TEXT["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))


def cached(model, toks, splits):
    cache, outs = model.new_cache(toks.shape[0]), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        for i, j in zip(splits[:-1], splits[1:]):
            outs.append(model(toks[:, i:j], cache=cache))
    assert cache.length == splits[-1]
    return torch.cat(outs, 1)


def test_load_recognises_v41_and_reads_config(ckpt):
    model = load(ckpt)
    assert isinstance(model, DeepSeekV41)
    cfg = model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_vocab, cfg.hc_mult) == (7, 4, 1, 64, 128, 4)
    assert cfg.compress_ratios == (0, 0, 2, 2, 1, 1, 1)  # the draft layer's entry is not a backbone layer
    assert cfg.local_window == 8 and cfg.index_topk == 6 and cfg.device == torch.device("cpu") and cfg.dtype == torch.float64
    md = model.analysis_metadata
    assert md["architecture"] == "deepseek_v41" and md["quantize"] is None and md["model_modified"] is False
    assert model.default_task is None and model.returns_query_logits


def test_geometry_has_period_two(model, ckpt):
    assert model.phase_specs == [None, None, PhaseSpec(2), PhaseSpec(2), None, None, None]
    spec = model.analysis_spec
    assert spec == PhaseSpec(2) and spec.origin == 0
    t = torch.arange(12)
    assert spec.phase(t).tolist() == [0, 1] * 6
    assert spec.is_boundary(t).tolist() == [False, True] * 6
    assert spec.visible_entries(t).tolist() == ((t + 1) // 2).tolist()
    with pytest.raises(phaselens.errors.PhaseGeometryError):
        load(ckpt, analysis_stride=3)  # not 2 nor a multiple: mixes the phases (4 refines them: accepted)


def test_sharing_map_and_hook_table(model):
    assert model.sharing == {2: {"kv_source": 2, "index_source": 2}, 3: {"kv_source": 2, "index_source": 2},
                             4: {"kv_source": 4, "index_source": 4}, 5: {"kv_source": 4, "index_source": 5},
                             6: {"kv_source": 4, "index_source": 5}}
    names = model.hook_dict

    def layers(site):
        return [i for i in range(7) if f"blocks.{i}.attn.{site}" in names]

    assert layers("hook_gate") == [2]  # ratio 1 pools nothing: no gate
    assert layers("hook_payload") == layers("hook_entry") == [2, 4]  # KV sources only
    assert layers("hook_indexer_topk") == [2, 4, 5] and layers("hook_candidates") == [4]
    assert layers("hook_pattern_entry") == [2, 3, 4, 5, 6]
    # consumers own no compressor or index keys; layer 5 has a query side but scores layer 4's keys
    params = dict(model.named_parameters())
    assert not any(k.startswith(("blocks.3.attn.compressor", "blocks.3.attn.indexer")) for k in params)
    assert "blocks.5.attn.indexer.wq_b.weight" in params and "blocks.5.attn.indexer.wk.weight" not in params
    assert "blocks.4.attn.compressor.wgate.weight" not in params and "blocks.2.attn.compressor.wgate.weight" in params


@pytest.mark.parametrize(("topk", "quantize", "splits"), [
    (None, None, [0, 7, 8, 9, 14, T]),
    ("all", "fp8", [0, 2, 3, 12, 13, T]),
    pytest.param(None, None, list(range(T + 1)), marks=pytest.mark.slow),
    pytest.param(None, "kv", [0, 7, 8, 9, 14, T], marks=pytest.mark.slow),
    pytest.param("all", None, list(range(T + 1)), marks=pytest.mark.slow),
])
def test_forward_equals_cached_decode(ckpt, topk, quantize, splits):
    """Chunked prefill and decoding through the cache (single-token steps at even and odd slots) give the
    parallel forward's logits. In fp64: with a binding index_topk, the MoE router's top-2 or FP8 round trips, a
    last-bit difference of fp32 summation order between the two paths could flip a pick or a rounding on some
    CPU."""
    model = load(ckpt, dtype=torch.float64, index_topk=topk, quantize=quantize)
    toks = tokens()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        full = model(toks)
        assert (cached(model, toks, splits) - full).abs().max() < 1e-10
    assert model.analysis_metadata["index_topk_binding"] is (topk is None)


def test_one_token_decoding_quantizes_the_same_rows_as_the_forward(ckpt):
    """Every token a separate step, with the FP8/FP4 round trips: in fp64 the cache must reproduce the forward
    to fp64 rounding. A round trip over a different set of rows or groups when one token is written at a time
    (a partial pooling group quantized, the open group re-quantized each step) would move the logits by a
    quantization step (~1e-2), not 1e-12. The bf16 differences in docs/deepseek_v41.md's table of cached decoding
    on the tiny checkpoint come from fp32 GEMM rounding instead (same page, "Cached decoding in bf16")."""
    model = load(ckpt, quantize="fp8")  # the window, entry and index round trips plus FP8 GEMM inputs
    n = 12  # 6 ratio-2 groups; index_topk (6) binds at the ratio-1 layers from slot 6 on
    toks = tokens(n=n)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        full = model(toks)
        assert (cached(model, toks, list(range(n + 1))) - full).abs().max() < 1e-10
    assert model.analysis_metadata["index_topk_binding"] is True


def test_query_logits_are_the_last_rows(model):
    toks = tokens()
    full = model(toks)
    assert torch.allclose(model(toks, logits="query", query_len=5), full[:, -5:], atol=1e-12)
    with pytest.raises(InputError):
        model(toks, logits="query", query_len=T + 1)


def test_visibility_rule(model_all):
    """Entry j is attended at slot t iff j < (t + 1) // r (every visible entry, with index_topk='all')."""
    model = model_all
    names = [f"blocks.{i}.attn.hook_pattern_{s}" for i in (3, 6) for s in ("local", "entry", "sink")]
    _, c = model.run_with_cache(tokens(), names_filter=names)
    t = torch.arange(T)
    for layer, r in ((3, 2), (6, 1)):
        pe = c[f"blocks.{layer}.attn.hook_pattern_entry"]
        assert pe.shape == (2, 4, T, (T // r))
        vis = torch.arange(pe.shape[-1]) < ((t + 1) // r)[:, None]
        assert torch.equal(pe > 0, vis.expand_as(pe))
        total = pe.sum(-1) + c[f"blocks.{layer}.attn.hook_pattern_local"].sum(-1) + c[f"blocks.{layer}.attn.hook_pattern_sink"]
        assert (total - 1).abs().max() < 1e-12


def test_gate_payload_and_entry_agree(model_all):
    """hook_gate is a softmax over the 2 slots per channel; pooling the payload with it, the norm and RoPE at
    slot 2j give hook_entry exactly."""
    model = model_all
    _, c = model.run_with_cache(tokens(), names_filter=lambda n: n.startswith("blocks.2.attn.hook_") and n[-5:] in ("_gate", "yload", "entry"))
    alpha, payload, entry = (c[f"blocks.2.attn.hook_{s}"] for s in ("gate", "payload", "entry"))
    assert alpha.shape == payload.shape == (2, T // 2, 2, 1, 64) and entry.shape == (2, T // 2, 1, 64)
    assert (alpha.sum(2) - 1).abs().max() < 1e-12
    attn = model.blocks[2].attn
    latent = attn.compressor.norm((alpha * payload).sum(2).squeeze(2))
    rebuilt = rope(latent, torch.arange(T // 2) * 2, attn.inv_freq)
    assert (rebuilt - entry.squeeze(2)).abs().max() < 1e-12


def test_an_edited_shared_entry_changes_every_reader(model_all):
    model = model_all
    toks = tokens()
    watch = ["blocks.3.attn.hook_pattern_entry", "blocks.4.attn.hook_pattern_local"]
    _, clean = model.run_with_cache(toks, names_filter=watch)

    def zero_last(entry, hook):
        entry = entry.clone()
        entry[:, -1] = 0
        return entry

    with model.hooks(fwd_hooks=[("blocks.2.attn.hook_entry", zero_last)]):
        _, edited = model.run_with_cache(toks, names_filter=watch)
    last = T // 2 - 1
    pe_c, pe_e = clean[watch[0]], edited[watch[0]]
    assert torch.equal(pe_c[..., : 2 * last + 1, :], pe_e[..., : 2 * last + 1, :])  # before the entry is visible
    assert (pe_c[..., 2 * last + 1 :, last] - pe_e[..., 2 * last + 1 :, last]).abs().min() > 0  # layer 3 reads it
    assert not model.hook_dict["blocks.2.attn.hook_entry"].fwd_hooks  # removed on exit
    # in decoding, the edited entry is what the cache stores and every later query of layers 2-7 reads
    cache = model.new_cache(2)
    with model.hooks(fwd_hooks=[("blocks.2.attn.hook_entry", zero_last)]):
        model(toks[:, : 2 * last + 2], cache=cache)
    assert cache.sources[2].entries[:, last].abs().max() == 0 and sorted(cache.sources) == [2, 4]


def test_index_picks_are_reused_between_sources(model):
    toks = tokens()
    names = [f"blocks.{i}.attn.hook_pattern_entry" for i in range(2, 7)]

    def none(picks, hook):
        return torch.full_like(picks, -1)

    with model.hooks(fwd_hooks=[("blocks.5.attn.hook_indexer_topk", none)]):
        _, c = model.run_with_cache(toks, names_filter=names)
    assert c["blocks.5.attn.hook_pattern_entry"].abs().max() == 0
    assert c["blocks.6.attn.hook_pattern_entry"].abs().max() == 0  # layer 6 reuses layer 5's picks
    assert c["blocks.4.attn.hook_pattern_entry"].sum() > 0 and c["blocks.3.attn.hook_pattern_entry"].sum() > 0
    _, c = model.run_with_cache(toks, names_filter=names + ["blocks.4.attn.hook_candidates",
                                                             "blocks.5.attn.hook_indexer_topk"])
    picked = c["blocks.6.attn.hook_pattern_entry"][:, 0] > 0
    assert torch.equal(picked, c["blocks.5.attn.hook_pattern_entry"][:, 0] > 0)
    assert (picked.sum(-1) <= 6).all()  # index_topk
    cand = c["blocks.4.attn.hook_candidates"]
    assert not (picked & ~cand).any()  # layer 5 picks only inside layer 4's candidate blocks
    newest = torch.arange(T)  # ratio 1: the newest visible entry of slot t is t; its block is always kept
    assert cand[:, newest, newest].all()
    assert (cand.sum(-1) <= 3 * 4).all()


def test_index_topk_all_lifts_truncation_and_filter(ckpt):
    model = load(ckpt, index_topk="all")
    md = model.analysis_metadata
    assert md["model_modified"] and md["index_topk"] == "all"
    called = []
    with model.hooks(fwd_hooks=[("blocks.4.attn.hook_candidates", lambda t, hook: called.append(1))]):
        model(tokens())
    assert not called
    with pytest.warns(IndexTopKWarning, match="index_topk=6"):
        phaselens.load(f"hf:{ckpt}", dtype=torch.float32)(tokens(seed=3))


def test_failed_call_leaves_cache_and_hooks_clean(model_all):
    model = model_all
    cache = model.new_cache(2)
    model(tokens()[:, :5], cache=cache)

    def boom(t, hook):
        raise RuntimeError("user hook failed")

    with pytest.raises(RuntimeError, match="user hook"):
        model.run_with_hooks(tokens()[:, 5:9], cache=cache, fwd_hooks=[("blocks.6.attn.hook_z", boom)])
    assert cache.length == 5 and cache.sources[4].entries.shape[1] == 5
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())
    with pytest.raises(InputError, match="0..127"):
        model(torch.tensor([[1, 128]]))


def test_engram_runs_by_default_and_drop_is_explicit(tmp_path):
    """Engram is part of the model unless dropped on request (warned, recorded); more in test_deepseek_v41_engram."""
    root = write_tiny_checkpoint(tmp_path / "engram", engram=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", phaselens.models.deepseek_v41.EngramDroppedWarning)
        md = load_v41(root, dtype=torch.float32).analysis_metadata
    assert md["engram"] == "applied" and md["model_modified"] is False
    with pytest.warns(phaselens.models.deepseek_v41.EngramDroppedWarning):
        model = load_v41(root, engram="drop", dtype=torch.float32)
    md = model.analysis_metadata
    assert md["engram"] == "dropped" and md["model_modified"] and "Engram" in md["modifications"][0]
    with pytest.raises(InputError, match="'run' or 'drop'"):
        load_v41(root, engram="refuse")


def test_damaged_checkpoints_raise_clear_errors(tmp_path):
    root = write_tiny_checkpoint(tmp_path / "bad")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    (root / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lacks shards"):
        load_v41(root)
    root = write_tiny_checkpoint(tmp_path / "bad2", hidden_size=96)
    cfg = json.loads((root / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 64
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json and the weights disagree"):
        load_v41(root)
    with pytest.raises(UnsupportedModelError, match="KV source"):
        write_tiny_checkpoint(tmp_path / "bad3", kv_source_layer_ids=[2])  # layer 4 (ratio 1) has no source
        load_v41(tmp_path / "bad3")
    assert index["weight_map"]


# The released DeepSeek-V4.1-Flash text_config (facts from its public config.json; no weights).
FLASH_TEXT = dict(
    TINY_TEXT, vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8, max_position_embeddings=1048576,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 65536},
    n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=2304, sliding_window=128,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3, kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8, engram_layer_ids=[1, 14],
    num_nextn_predict_layers=3,
)


def test_released_flash_config_topology():
    from phaselens.models.deepseek_v41 import V41Config

    cfg = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": FLASH_TEXT})
    roles = cfg.topology()
    kv = {r.layer: r.kv_source for r in roles if r.compressed}
    idx = {r.layer: r.index_source for r in roles if r.compressed}
    assert [kv[i] for i in (2, 7, 8, 13, 14, 19, 20, 39)] == [2, 2, 8, 8, 14, 14, 20, 20]
    assert [idx[i] for i in (19, 20, 23, 24, 27, 36, 39)] == [14, 20, 20, 24, 24, 36, 36]
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.layer for r in roles if r.is_candidate_source] == [20]
    assert cfg.rope_factor == 16 and cfg.rope_original_max_position == 65536 and len(cfg.compress_ratios) == 40
    assert (cfg.candidate_topk_blocks * cfg.candidate_block_size) == 16384  # the filter binds past 16,384 entries


def test_truncated_model_matches_the_full_models_first_layers(ckpt, model_all):
    small = load(ckpt, index_topk="all", n_layers=3)
    assert small.cfg.n_layers == 3 and small.cfg.kv_source_layer_ids == (2,)
    assert "truncated to the first 3 layers" in small.analysis_metadata["modifications"]
    name = "blocks.2.hook_resid_post"
    _, a = small.run_with_cache(tokens(), names_filter=name)
    _, b = model_all.run_with_cache(tokens(), names_filter=name)
    assert torch.equal(a[name], b[name])


def test_hook_context_in_decoding(model_all):
    """Hooks get the call's first slot and, at compressor hooks, the index of the first new entry (per ratio)."""
    seen = {}

    def keep(t, hook):
        seen[hook.name] = (hook.query_start, hook.first_entry, hook.layer(), t.shape[1])

    cache = model_all.new_cache(2)
    model_all(tokens()[:, :9], cache=cache)
    names = ["blocks.2.attn.hook_gate", "blocks.2.attn.hook_entry", "blocks.4.attn.hook_entry", "blocks.6.attn.hook_z"]
    model_all.run_with_hooks(tokens()[:, 9:14], cache=cache, fwd_hooks=[(n, keep) for n in names])
    # slots 9..13: ratio 2 completes entries 4 (slots 8, 9), 5 and 6; ratio 1 adds entries 9..13
    assert seen == {"blocks.2.attn.hook_gate": (9, 4, 2, 3), "blocks.2.attn.hook_entry": (9, 4, 2, 3),
                    "blocks.4.attn.hook_entry": (9, 9, 4, 5), "blocks.6.attn.hook_z": (9, None, 6, 5)}
    with pytest.raises(phaselens.errors.HookNameError, match="hook_pattern_local"):
        model_all.run_with_hooks(tokens(), fwd_hooks=[("blocks.3.attn.hook_pattern", keep)])
