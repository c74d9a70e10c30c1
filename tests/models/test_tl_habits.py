"""TransformerLens habits on phaselens' own models (issue 34, item 4): the TL-idiom table, run on the zoo model
and the DeepSeek-V4 adapter (and, where the kind differs, V4.1 and a transformers causal LM), against the
installed transformer_lens and nnsight."""

from __future__ import annotations

import warnings

import pytest
import torch
from nnsight import NNsight
from transformer_lens import ActivationCache, patching

import phaselens
from phaselens.errors import HookNameError, InputError, UnsupportedModelError
from tests.support.causal_lm import save_tokenizer, tiny_causal_lm
from tests.support.deepseek import tiny_v4_model
from tests.support.models import LAYOUTS, make_model

T = 24


@pytest.fixture(scope="module")
def zoo():
    model = phaselens.load("zoo:w8s4")
    toks = torch.randint(0, model.cfg.d_vocab, (2, T), generator=torch.Generator().manual_seed(0))
    logits, cache = model.run_with_cache(toks)
    return model, toks, logits, cache


@pytest.fixture(scope="module")
def v4():
    model = phaselens.from_hf(tiny_v4_model())
    toks = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(1))
    logits, cache = model.run_with_cache(toks)
    return model, toks, logits, cache


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from tests.support.deepseek_v41 import TINY_TEXT, write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp_path_factory.mktemp("v41tl") / "tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = phaselens.load(f"hf:{root}", dtype=torch.float32, index_topk="all")
    toks = torch.randint(0, TINY_TEXT["vocab_size"], (1, 17), generator=torch.Generator().manual_seed(2))
    return model, toks


def metric(logits):
    return logits[:, -1].logsumexp(-1).sum()


# ---- run_with_cache: a TransformerLens ActivationCache, keys and errors ---------------------------------
def test_every_kind_returns_an_activation_cache_with_tl_fields(zoo, v4, v41):
    qwen = phaselens.load(tiny_causal_lm("qwen3"), stride=4)
    kinds = [(zoo[0], zoo[1]), (v4[0], v4[1]), v41, (qwen, torch.tensor([[5, 6, 7, 8, 9]]))]
    for model, toks in kinds:
        logits, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_z"))
        assert isinstance(cache, ActivationCache) and cache.model is model
        assert sorted(cache.keys()) == sorted(n for n in model.hook_dict if n.endswith("hook_z"))
        assert cache["z", 0].shape[:2] == toks.shape
        assert torch.equal(cache["z", -1], cache[f"blocks.{model.cfg.n_layers - 1}.attn.hook_z"])
        assert model.cfg.normalization_type == "RMS" and model.cfg.attn_only is False
        assert torch.allclose(logits, model(toks))


def test_tuple_keys_resolve_phaselens_names(zoo, v4):
    _, _, _, cache = zoo
    assert cache["pattern_entry", 0] is cache["blocks.0.attn.hook_pattern_entry"]
    assert cache["pattern_entry", 0].shape == (2, 4, T, T // 4)
    assert cache["gate", 1] is cache["blocks.1.attn.hook_gate"]
    assert cache["kv", 0].shape == (2, T, 4, 16) and cache["resid_pre", 1].shape == (2, T, 64)
    assert cache["pre", 0] is cache["blocks.0.mlp.hook_pre"] and cache["embed"] is cache["hook_embed"]
    _, _, _, c4 = v4
    assert c4["pattern_entry", 1].shape == (2, 4, 20, 5) and c4["kv", 2].shape == (2, 20, 1, 64)
    assert ("pattern_entry", 1) in c4 and ("pattern_entry", 0) not in c4  # layer 0 is a sliding layer


def test_a_missing_name_is_a_hook_name_error_that_says_what_exists(zoo, v4):
    for cache in (zoo[3], v4[3]):
        for key in ("blocks.0.attn.hook_k", ("k", 0), ("v", 0)):
            with pytest.raises(HookNameError, match=r"one tensor.*blocks\.0\.attn\.hook_kv"):
                cache[key]
        with pytest.raises(HookNameError, match="hook_pattern_local"):
            cache["pattern", 0]
    _, toks, _, _ = zoo
    _, only_z = zoo[0].run_with_cache(toks, names_filter="blocks.0.attn.hook_z")
    with pytest.raises(HookNameError, match="names_filter left it out"):
        only_z["q", 0]
    with pytest.raises(HookNameError, match="Did you mean blocks.0.attn.hook_z"):
        only_z["blocks.0.attn.hook_zz"]


def test_a_names_filter_that_selects_nothing_raises(zoo, v4):
    for model, toks, _, _ in (zoo, v4):
        with pytest.raises(HookNameError, match=r"written for 'blocks\.0\.attn\.hook_pattern'.*hook_pattern_local"):
            model.run_with_cache(toks, names_filter=lambda n: n.endswith("pattern"))
        with pytest.raises(HookNameError, match="hook_kv"):
            model.run_with_cache(toks, names_filter=["blocks.0.attn.hook_v"])
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("pattern_sink"))
        assert len(cache) == model.cfg.n_layers


# ---- the residual methods ------------------------------------------------------------------------------
def test_residual_methods_add_up_on_the_zoo_model(zoo):
    model, toks, logits, cache = zoo
    acc, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"] and torch.equal(acc[-1], cache["resid_post", 1])
    lens = cache.accumulated_resid(apply_ln=True, pos_slice=-1)  # the logit lens: ln_final recomputed per row
    assert torch.allclose(lens[-1] @ model.W_U, logits[:, -1], atol=1e-4)
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    assert torch.allclose(parts.sum(0), cache["resid_post", 1], atol=1e-5)
    target = toks[:, -1]
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens=target, pos_slice=-1)
    assert attrs.shape == (5, 2)
    assert torch.allclose(attrs.sum(0), logits[torch.arange(2), -1, target], atol=1e-4)
    scaled = cache.decompose_resid(apply_ln=True, pos_slice=-1).sum(0) * model.ln_final.weight
    assert torch.allclose(scaled @ model.W_U, logits[:, -1], atol=1e-4)
    assert cache.stack_activation("pattern_entry").shape == (2, 2, 4, T, T // 4)
    heads = cache.stack_head_results(pos_slice=-1)  # [layer * head, batch, d_model] from hook_z and W_O
    assert heads.shape == (8, 2, 64)
    assert torch.allclose(heads[4:].sum(0), cache["attn_out", 1][:, -1], atol=1e-5)


def test_residual_methods_on_hyper_connections_refuse_with_the_reason(v4):
    _, _, _, cache = v4
    acc = cache.accumulated_resid()
    assert acc.shape == (5, 2, 20, 4, 64) and torch.equal(acc[2], cache["resid_pre", 2])
    for call in (cache.decompose_resid, lambda: cache.accumulated_resid(apply_ln=True),
                 lambda: cache.logit_attrs(acc, tokens=torch.tensor([1, 2])), cache.stack_head_results):
        with pytest.raises(UnsupportedModelError, match="hyper-connection|low-rank"):
            call()


# ---- TransformerLens's patching ------------------------------------------------------------------------
def test_tl_patching_runs_or_says_why(zoo, v4):
    model, toks, _, cache = zoo
    corrupted = toks.flip(0)
    out = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)
    base = metric(model(corrupted)).item()
    assert out.shape == (2, 4) and (out - base).abs().max() > 1e-3
    for fn, why in ((patching.get_act_patch_attn_head_k_all_pos, "hook_kv"),
                    (patching.get_act_patch_attn_head_v_all_pos, "hook_kv"),
                    (patching.get_act_patch_attn_head_pattern_all_pos, "split into")):
        for m, t, c in ((model, corrupted, cache), (v4[0], v4[1].flip(0), v4[3])):
            with pytest.raises(HookNameError, match=why):
                fn(m, t, c, metric)
    control = make_model(None)  # full attention, separate K and V (2 KV heads): TL's functions run as written
    clean = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(4))
    _, ccache = control.run_with_cache(clean)
    k = patching.get_act_patch_attn_head_k_all_pos(control, clean.flip(1), ccache, metric)
    p = patching.get_act_patch_attn_head_pattern_all_pos(control, clean.flip(1), ccache, metric)
    assert k.shape == (2, 2) and p.shape == (2, 4) and (p - metric(control(clean.flip(1)))).abs().max() > 1e-4


# ---- tokenizer, generate -------------------------------------------------------------------------------
def test_tokenizer_helpers_work_with_a_tokenizer_and_name_the_fix_without(zoo, v4, tmp_path):
    model, toks, _, _ = zoo
    m = v4[0]
    for call in (lambda: m.tokenizer, lambda: m.to_str_tokens(toks[0]), lambda: m.to_string(toks[0])):
        with pytest.raises(InputError, match=r"model.tokenizer = "):
            call()
    # the zoo's own tokenizer is word-level: id N is the word tN, BOS (t1) first, every id round-trips
    assert model.to_str_tokens(torch.tensor([5, 7, 9])) == ["t5", "t7", "t9"]
    assert model.tokenizer("t3 t40")["input_ids"] == [1, 3, 40]
    assert model.tokenizer(model.to_string(toks[0]), add_special_tokens=False)["input_ids"] == toks[0].tolist()
    fresh = phaselens.load("zoo:w8s4")
    fresh.tokenizer = save_tokenizer(tmp_path / "tok", vocab=fresh.cfg.d_vocab)
    assert fresh.to_str_tokens(torch.tensor([5, 7, 9])) == ["t5", "t7", "t9"]
    assert fresh.to_string(torch.tensor([[5, 7], [1, 2]])) == ["t5 t7", "t1 t2"]
    assert fresh.to_single_token("t9") == 9 and fresh.to_str_tokens("t3") == ["t3"]
    # a transformers checkpoint directory with a tokenizer: found there, never downloaded
    hf = tiny_causal_lm("llama")
    hf.save_pretrained(tmp_path / "llama")
    save_tokenizer(tmp_path / "llama")
    loaded = phaselens.load(f"hf:{tmp_path / 'llama'}", stride=4)
    assert loaded.to_str_tokens(torch.tensor([3, 4])) == ["t3", "t4"]


def test_a_v41_checkpoint_finds_its_own_tokenizer(v41):
    """DeepSeek-V4.1 loaded from a directory reads that directory's tokenizer (Engram's), never a download."""
    model, toks = v41
    tok = model.tokenizer
    ids = toks[0, :5].tolist()
    assert model.to_str_tokens(torch.tensor(ids)) == [tok.decode([i]) for i in ids]
    assert isinstance(model.to_string(torch.tensor(ids)), str)


def test_generate_takes_verbose_and_refuses_what_it_cannot_honour(zoo, v4):
    model, toks, _, _ = zoo
    quiet = model.generate(toks[:, :8], 3)
    assert quiet.shape == (2, 11) and torch.equal(model.generate(toks[:, :8], 3, verbose=True), quiet)
    with pytest.raises(InputError, match="temperature"):
        model.generate(toks[:, :8], 3, temperature=0.7)
    with pytest.raises(UnsupportedModelError, match=r"adapter\.model\.generate"):
        v4[0].generate(v4[1], verbose=False)


# ---- read-only hooks, execution order --------------------------------------------------------------------
def test_edits_to_read_only_hooks_raise(zoo, v4, v41):
    for model, toks in ((zoo[0], zoo[1]), (v4[0], v4[1]), v41):
        name = "blocks.0.attn.hook_pattern_sink"
        with pytest.raises(InputError, match="read-only"):
            model.run_with_hooks(toks, fwd_hooks=[(name, lambda x, hook: x * 0)])
        same = model.run_with_hooks(toks, fwd_hooks=[(name, lambda x, hook: None)])
        assert torch.equal(same, model(toks))  # reading stays allowed
    envoy = NNsight(zoo[0])
    with pytest.raises(InputError, match="hook_pattern_sink is read-only"):
        with envoy.trace(zoo[1]):
            envoy.blocks[0].attn.hook_pattern_sink.output = envoy.blocks[0].attn.hook_pattern_sink.output * 0


def _envoy(root, name):
    for part in name.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def test_hook_points_are_listed_in_execution_order(zoo, v41):
    untied = make_model(LAYOUTS["w4s4-scalar"], mlp="swiglu")  # hook_gate_k/v, hook_entry_k/v, hook_pre_linear
    toks = torch.randint(0, 61, (1, 13), generator=torch.Generator().manual_seed(5))
    for model, t in ((zoo[0], zoo[1]), (untied, toks), v41):
        fired: list[str] = []
        model.run_with_hooks(t, fwd_hooks=[(lambda n: True, lambda x, hook, fired=fired: fired.append(hook.name))])
        # every hook fires once, in hook_dict's order (V4.1's candidate filter is lifted by index_topk="all")
        assert fired == [n for n in model.hook_dict if n in fired]
        assert {n for n in model.hook_dict if n not in fired} <= {"blocks.4.attn.hook_candidates"}
        assert len(fired) > 30
    # nnsight reads every hook in hook_dict's order in one trace, and sees run_with_cache's values
    model, t = zoo[0], zoo[1][:1]
    _, cache = model.run_with_cache(t)
    envoy, names, saved = NNsight(model), list(model.hook_dict), []
    with envoy.trace(t):
        for name in names:
            saved.append(_envoy(envoy, name).output.save())
    assert len(saved) == 31 and all(torch.equal(s, cache[n]) for s, n in zip(saved, names))
