"""DeepSeek-V4 adapter: geometry from the config, refusals, hook names and shapes, attention split, gates."""

from __future__ import annotations

import warnings

import pytest
import torch

import phaselens
from phaselens.contract.protocol import PhaseModel
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import CheckpointError, InputError, PhaseGeometryError, UnsupportedModelError
from phaselens.models.compressed.compressor import Compressor
from phaselens.models.deepseek_v4 import (
    DeepSeekV4Adapter,
    IndexTopKWarning,
    LayerTypesWarning,
    from_transformers,
    layer_geometry,
)
from phaselens.models.deepseek_v4 import gates as gate_math
from tests.support.deepseek import (
    VOCAB,
    attention_modules,
    compressor_modules,
    one_thread,  # noqa: F401  (autouse fixture)
    random_tokens,
    run_capturing,
    tiny_v4_config,
    tiny_v4_model,
)

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
T = 37


@pytest.fixture(scope="module")
def v4():
    return tiny_v4_model()


@pytest.fixture(scope="module")
def adapter(v4) -> DeepSeekV4Adapter:
    return from_transformers(v4)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, T, seed=0)


@pytest.fixture(scope="module")
def everything(adapter, tokens):
    """One forward recording every hook point (fine here: the model is tiny)."""
    with torch.no_grad():
        return adapter.run_with_cache(tokens)


# ---- geometry ----------------------------------------------------------------------------------------
def test_geometry_is_read_from_layer_types(adapter):
    assert isinstance(adapter, PhaseModel)
    assert adapter.phase_specs == [None, PhaseSpec(4, 8), PhaseSpec(16), PhaseSpec(4, 8)]
    assert adapter.analysis_stride == 4 and adapter.analysis_spec == PhaseSpec(4)
    assert adapter.analysis_metadata["origin"] == 0


def test_geometry_follows_a_different_layer_order_and_rates():
    cfg = tiny_v4_config(layer_types=[HCA, CSA, SW, CSA], compress_rates={CSA: 2, HCA: 8})
    assert [g.spec for g in layer_geometry(cfg)] == [PhaseSpec(8), PhaseSpec(2, 4), None, PhaseSpec(2, 4)]
    model = tiny_v4_model(layer_types=[HCA, SW, HCA, HCA])
    a = from_transformers(model)
    assert a.phase_specs == [PhaseSpec(16), None, PhaseSpec(16), PhaseSpec(16)]
    assert a.analysis_stride == 16  # the only compressed stride
    assert "blocks.0.attn.hook_indexer_topk" not in a.hook_dict  # HCA has no indexer
    assert "blocks.1.attn.hook_gate" not in a.hook_dict  # sliding layers have no compressor


def test_analysis_stride_choice(v4):
    assert from_transformers(v4, analysis_stride=16).analysis_spec == PhaseSpec(16)
    assert from_transformers(v4, analysis_stride=8).analysis_spec == PhaseSpec(8)  # a multiple of 4 refines its phases
    with pytest.raises(PhaseGeometryError, match=r"strides \[4, 16\]"):
        from_transformers(v4, analysis_stride=6)  # mixes the stride-4 phases (the one rule: phaselens.contract.strides)


# ---- refusals ----------------------------------------------------------------------------------------
def test_refuses_a_model_without_compressed_layers():
    with pytest.raises(UnsupportedModelError, match="no compressed layers"):
        from_transformers(tiny_v4_model(layer_types=[SW] * 4))


def test_refuses_non_eager_attention(v4):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    a = from_transformers(v4)
    for impl in ("sdpa", "flex_attention", None):
        v4.config._attn_implementation = impl
        try:
            with pytest.raises(UnsupportedModelError, match="attn_implementation='eager'"):
                from_transformers(v4)
            with pytest.raises(UnsupportedModelError):  # checked again at every forward
                a(torch.zeros(1, 4, dtype=torch.long))
        finally:
            v4.config._attn_implementation = "eager"
    ALL_ATTENTION_FUNCTIONS["eager"] = lambda *a, **k: None  # an "eager" that is not transformers' own
    try:
        with pytest.raises(UnsupportedModelError, match="overridden"):
            from_transformers(v4)
    finally:
        del ALL_ATTENTION_FUNCTIONS["eager"]


def test_refuses_other_models():
    from transformers import DeepseekV4Model, LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    for model in (llama, torch.nn.Linear(2, 2), object()):
        with pytest.raises(UnsupportedModelError, match="DeepSeek-V4"):
            from_transformers(model)
    with pytest.raises(UnsupportedModelError, match="DeepseekV4ForCausalLM"):
        from_transformers(DeepseekV4Model(tiny_v4_config()))


# ---- hooks -------------------------------------------------------------------------------------------
def test_hook_shapes_as_documented(adapter, everything):
    logits, cache = everything
    B, H, d, D, L, hc = 2, 4, 64, 64, 8, 4
    assert logits.shape == (B, T, VOCAB)
    assert set(cache) == set(adapter.hook_dict)
    assert cache["hook_embed"].shape == (B, T, D)
    for layer, spec in enumerate(adapter.phase_specs):
        p = f"blocks.{layer}"
        assert cache[f"{p}.hook_resid_pre"].shape == (B, T, hc, D)  # hyper-connection streams
        assert cache[f"{p}.hook_resid_post"].shape == (B, T, hc, D)
        assert cache[f"{p}.hook_resid_mid"].shape == (B, T, hc, D)
        assert cache[f"{p}.attn.hook_q"].shape == cache[f"{p}.attn.hook_z"].shape == (B, T, H, d)
        assert cache[f"{p}.attn.hook_kv"].shape == (B, T, 1, d)
        assert cache[f"{p}.hook_attn_out"].shape == cache[f"{p}.hook_mlp_out"].shape == (B, T, D)
        assert cache[f"{p}.attn.hook_pattern_local"].shape == (B, H, T, L)
        assert cache[f"{p}.attn.hook_pattern_sink"].shape == (B, H, T)
        if spec is None:
            assert f"{p}.attn.hook_pattern_entry" not in cache
            continue
        E = T // spec.stride
        assert cache[f"{p}.attn.hook_pattern_entry"].shape == (B, H, T, E)
        assert (
            cache[f"{p}.attn.hook_gate"].shape
            == cache[f"{p}.attn.hook_payload"].shape
            == (B, E, spec.window, 1, d)
        )
        assert cache[f"{p}.attn.hook_entry"].shape == (B, E, 1, d)
        if spec.overlapping:
            assert cache[f"{p}.attn.hook_indexer_topk"].shape == (B, T, E)  # index_topk 64 > E
    for name, point in adapter.hook_dict.items():
        assert point.name == name and point.shape.startswith("[B")


def test_attention_split_sums_to_one_with_an_independent_sink(adapter, tokens, everything):
    _, cache = everything
    _, calls = run_capturing(adapter, tokens, attention_modules(adapter))
    eager = {i: out[1] for i, [(_, out)] in calls.items()}  # one call per layer: (args, (output, probs))
    for layer, spec in enumerate(adapter.phase_specs):
        p = f"blocks.{layer}.attn"
        local, sink = cache[f"{p}.hook_pattern_local"], cache[f"{p}.hook_pattern_sink"]
        entry = cache[f"{p}.hook_pattern_entry"] if f"{p}.hook_pattern_entry" in cache.keys() else local[..., :0]
        total = local.sum(-1) + entry.sum(-1) + sink
        assert (total - 1).abs().max() <= 1e-5
        assert (sink > 1e-4).any() and (sink < 1 - 1e-4).all()  # the sink is real, not vacuous
        probs = eager[layer]  # transformers' eager probabilities, sink column dropped: [B, H, T, T + E]
        E = entry.shape[-1]
        assert probs.shape[-1] == T + E and (probs[..., T:] - entry).abs().sum() <= 1e-5
        assert (probs[..., :T].sum(-1) - local.sum(-1)).abs().max() <= 1e-5  # nothing outside the band
        assert (1 - probs.sum(-1) - sink).abs().max() <= 1e-5  # agrees with the remainder, computed apart
        q, k = 20, 3  # band index k of query q is slot q - L + 1 + k
        assert torch.allclose(local[:, :, q, k], probs[:, :, q, q - 8 + 1 + k], atol=1e-6)
        assert (local[:, :, 2, :5] == 0).all()  # slots before 0
        assert E == (0 if spec is None else T // spec.stride)


def test_incomplete_windows_get_no_entry_mass(adapter, everything):
    _, cache = everything
    t = torch.arange(T)
    for layer, spec in enumerate(adapter.phase_specs):
        if spec is None:
            continue
        entry = cache[f"blocks.{layer}.attn.hook_pattern_entry"]
        visible = torch.as_tensor(spec.visible_entries(t.numpy()))  # j < (t + 1) // S
        j = torch.arange(entry.shape[-1])
        hidden = j[None, :] >= visible[:, None]  # [T, E]: windows not complete at query t
        assert (entry[:, :, hidden] == 0).all()
        assert (entry[:, :, ~hidden] > 0).all()
        assert (entry[:, :, : spec.stride - 1].sum(-1) == 0).all()  # queries before the first boundary
    # Token t = 29 (CSA block 7 = slots 28..31; HCA block 1 = slots 16..31): until its window completes, no
    # query reaches it through an entry (only through the local window); from then on, queries do.
    t = 29
    for layer, spec in enumerate(adapter.phase_specs):
        if spec is None:
            continue
        entry = cache[f"blocks.{layer}.attn.hook_pattern_entry"]
        for j in spec.entries_containing(t):
            for q in range(t, T):
                mass = entry[:, :, q, j] if j < entry.shape[-1] else torch.zeros(1)
                if q < spec.completes_at(j):
                    assert (mass == 0).all(), (layer, j, q)
                else:
                    assert (mass > 0).all(), (layer, j, q)


def test_gate_reconstruction_reproduces_the_compressor_rows(adapter, tokens, everything):
    _, cache = everything
    compressors = compressor_modules(adapter)
    _, calls = run_capturing(adapter, tokens, compressors)
    for layer, [(args, out)] in calls.items():
        hidden, out = args[0], out[0]
        p = f"blocks.{layer}.attn"
        comp = compressors[layer]
        alpha, payload, entry = cache[f"{p}.hook_gate"], cache[f"{p}.hook_payload"], cache[f"{p}.hook_entry"]
        rows = gate_math.finish(comp, gate_math.pool(alpha, payload), 0)
        assert (rows - out[:, 0]).abs().max() <= 1e-6  # our gates + payloads rebuild the model's rows
        assert (entry[:, :, 0] - out[:, 0]).abs().max() == 0
        assert (alpha.sum(2) - 1).abs().max() <= 1e-6  # a softmax over the W slots, per channel
        ours = Compressor.from_hf(comp).poolers["kv"]  # phaselens' own compressor, an independent layout
        ref_alpha, ref_payload, _, _ = ours.gates(hidden, 0, None)
        assert (alpha - ref_alpha).abs().max() <= 1e-6
        assert (payload - ref_payload).abs().max() <= 1e-5
        if alpha.shape[2] == 8:  # CSA: entry 0's previous-block slots lie before the origin
            assert (alpha[:, 0, :4] == 0).all() and (payload[:, 0, :4] == 0).all()


def test_editing_hooks_changes_the_model(adapter, tokens, everything):
    clean, cache = everything
    with torch.no_grad():
        uniform = adapter.run_with_hooks(
            tokens,
            fwd_hooks=[("blocks.1.attn.hook_gate", lambda a, hook: torch.full_like(a, 1 / a.shape[2]))],
        )
        rows_seen = {}
        adapter.run_with_hooks(
            tokens,
            fwd_hooks=[
                ("blocks.1.attn.hook_gate", lambda a, hook: torch.full_like(a, 1 / a.shape[2])),
                ("blocks.1.attn.hook_entry", lambda e, hook: rows_seen.setdefault("e", e.clone())),
            ],
        )
        zeroed = adapter.run_with_hooks(
            tokens, fwd_hooks=[("blocks.2.attn.hook_entry", lambda e, hook: e * 0)]
        )
    assert (uniform - clean).abs().max() > 1e-4 and (zeroed - clean).abs().max() > 1e-4
    assert (rows_seen["e"] - cache["blocks.1.attn.hook_entry"]).abs().max() > 1e-4  # the entries were rebuilt
    with torch.no_grad():  # returning the given tensor: a read on read-only sites, an edit on editable ones
        same = adapter.run_with_hooks(
            tokens, fwd_hooks=[("blocks.1.attn.hook_pattern_entry", lambda p, hook: p)]
        )
        halved = adapter.run_with_hooks(
            tokens, fwd_hooks=[("blocks.1.attn.hook_payload", lambda p, hook: p.mul_(0.5))]
        )
    assert torch.equal(same, clean) and (halved - clean).abs().max() > 1e-4
    with pytest.raises(InputError, match="read-only"):
        adapter.run_with_hooks(
            tokens, fwd_hooks=[("blocks.1.attn.hook_pattern_entry", lambda p, hook: p * 0)]
        )
    with pytest.raises(InputError, match="not a hook point"):
        adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_gate", lambda p, hook: None)])
    with pytest.raises(InputError, match="shape"):
        adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", lambda z, hook: z[:, :1])])


def test_hook_filters_and_names(adapter, tokens):
    seen = []
    with torch.no_grad():
        adapter.run_with_hooks(
            tokens[:, :9],
            fwd_hooks=[(lambda n: n.endswith("hook_z"), lambda z, hook: seen.append(hook.name))],
        )
    assert seen == [f"blocks.{i}.attn.hook_z" for i in range(4)]
    _, cache = adapter.run_with_cache(tokens[:, :9], names_filter=["blocks.1.attn.hook_gate", "hook_embed"])
    assert sorted(cache) == ["blocks.1.attn.hook_gate", "hook_embed"]


# ---- index_topk --------------------------------------------------------------------------------------
def test_index_topk_warning_records_the_picks():
    a = from_transformers(tiny_v4_model(index_topk=4))
    toks = torch.randint(0, VOCAB, (1, T))
    with pytest.warns(IndexTopKWarning, match=r"index_topk=4 < 9 entries"):
        _, cache = a.run_with_cache(toks, names_filter="blocks.3.attn.hook_indexer_topk")
    assert sorted(a.indexer_picks) == [1, 3] and a.indexer_picks[1].shape == (1, T, 4)
    assert torch.equal(a.indexer_picks[3], cache["blocks.3.attn.hook_indexer_topk"])
    assert (a.indexer_picks[1][:, :3] == -1).all()  # nothing to pick before the first boundary
    md = a.analysis_metadata
    assert md["index_topk_binding"] and not md["model_modified"] and md["max_entries_seen"] == 9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a(toks[:, :16])  # 4 entries: every one is kept, no warning
    assert a.indexer_picks == {}


def test_index_topk_all_changes_the_model_and_says_so():
    model = tiny_v4_model(index_topk=4)
    a = from_transformers(model, index_topk="all")
    md = a.analysis_metadata
    assert md["model_modified"] and "index_topk 4 -> all" in md["modifications"][0]
    assert model.model.layers[1].self_attn.compressor.indexer.index_topk > 65536
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a(torch.randint(0, VOCAB, (1, T)))
    assert from_transformers(model).analysis_metadata["model_modified"]  # a later adapter of the changed model too
    assert not from_transformers(tiny_v4_model()).analysis_metadata["model_modified"]


# ---- loading -----------------------------------------------------------------------------------------
def test_load_hf_from_a_local_directory(tmp_path, v4, tokens):
    v4.save_pretrained(tmp_path / "ckpt")
    a = phaselens.load(f"hf:{tmp_path / 'ckpt'}", dtype=torch.float32)
    assert isinstance(a, DeepSeekV4Adapter) and a.phase_specs == from_transformers(v4).phase_specs
    with torch.no_grad():
        assert (a(tokens[:, :12]) - v4(tokens[:, :12]).logits).abs().max() <= 1e-6
    with pytest.raises(CheckpointError, match="never downloads"):
        phaselens.load(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(UnsupportedModelError, match="eager"):
        phaselens.load(f"hf:{tmp_path / 'ckpt'}", attn_implementation="sdpa")


def test_load_hf_warns_when_layer_types_come_from_the_default(tmp_path):
    import json

    model = tiny_v4_model(layer_types=[HCA, HCA, HCA, CSA])  # transformers' default for 4 layers
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(LayerTypesWarning, match="pass layer_types"):
        a = phaselens.load(f"hf:{tmp_path}")
    assert a.phase_specs == [PhaseSpec(16)] * 3 + [PhaseSpec(4, 8)]
