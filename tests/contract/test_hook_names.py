"""What a TransformerLens user reaches for: hook_pattern on a split layer, and W_Q-style weight views."""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.errors import HookNameError, PhaseLensError
from tests.support.models import LAYOUTS, make_model

T = 23


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 61, (2, T), generator=torch.Generator().manual_seed(0))


def _no_hooks_left(model) -> bool:
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values())


def test_hook_pattern_on_a_compressed_layer_explains_the_split(tokens):
    model = make_model(LAYOUTS["w4s4-scalar"])
    with pytest.raises(HookNameError) as err:
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, hook: None)])
    msg = str(err.value)
    for part in ("hook_pattern_local", "hook_pattern_entry", "hook_pattern_sink", "compressed layer",
                 "combined_pattern"):
        assert part in msg
    assert not msg.startswith('"')  # printed as a sentence, not as KeyError's quoted repr
    assert isinstance(err.value, KeyError) and isinstance(err.value, PhaseLensError)
    assert _no_hooks_left(model)
    with pytest.raises(HookNameError, match="hook_pattern_entry"):
        model.hook_dict["blocks.1.attn.hook_pattern"]
    with pytest.raises(KeyError, match="Did you mean blocks.1.attn.hook_z"):  # a typo gets suggestions
        model.hook_dict["blocks.1.attn.hook_zz"]
    control = make_model(None)  # full attention keeps TransformerLens's hook_pattern
    assert "blocks.0.attn.hook_pattern" in control.hook_dict


@pytest.mark.parametrize("name", ["w4s4-scalar", "w8s4-peroffset"])
def test_combined_pattern_is_exactly_the_attention_that_made_z(tokens, name):
    """Rebuild hook_z from the combined pattern and the values it weighs: it must match the model's own z."""
    model = make_model(LAYOUTS[name])
    _, cache = model.run_with_cache(tokens)
    cfg = model.cfg
    L, H, Hkv, d = cfg.local_window, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    for layer in range(cfg.n_layers):
        comb = phaselens.contract.hooknames.combined_pattern(cache, layer)  # [B, H, T, L + E + 1]
        E = cache[f"blocks.{layer}.attn.hook_pattern_entry"].shape[-1]
        assert comb.shape == (2, H, T, L + E + 1)
        assert torch.allclose(comb.sum(-1), torch.ones(2, H, T), atol=1e-5)
        v = cache[f"blocks.{layer}.attn.hook_v"]  # [B, T, Hkv, d]: values carry no RoPE on separate K/V
        v_pad = torch.nn.functional.pad(v, (0, 0, 0, 0, L - 1, 0))
        window = v_pad.unfold(1, L, 1).permute(0, 1, 4, 2, 3)  # [B, T, L, Hkv, d]: slot q - L + 1 + i
        entries = cache[f"blocks.{layer}.attn.hook_entry_v"]  # [B, E, Hkv, d]
        keys = torch.cat([window, entries[:, None].expand(-1, T, -1, -1, -1),
                          torch.zeros(2, T, 1, Hkv, d)], dim=2)  # [B, T, L + E + 1, Hkv, d]
        keys = keys.repeat_interleave(H // Hkv, dim=3)  # KV-major: head h reads KV head h // G
        z = torch.einsum("bhqk,bqkhd->bqhd", comb, keys)
        assert torch.allclose(z, cache[f"blocks.{layer}.attn.hook_z"], atol=1e-5)


def test_combined_pattern_on_full_attention_and_without_the_parts(tokens):
    control = make_model(None)
    _, cache = control.run_with_cache(tokens)
    assert phaselens.contract.hooknames.combined_pattern(cache, 1) is cache["blocks.1.attn.hook_pattern"]
    with pytest.raises(HookNameError, match="names_filter"):
        phaselens.contract.hooknames.combined_pattern({}, 0)


@pytest.mark.parametrize("name", ["w4s4-scalar", "w8s4-deepseek"])
def test_weight_views_have_transformer_lens_shapes_and_reproduce_the_hooks(tokens, name):
    model = make_model(LAYOUTS[name])
    cfg = model.cfg
    Lyr, H, D, d = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    assert model.W_Q.shape == model.W_K.shape == model.W_V.shape == (Lyr, H, D, d)
    assert model.W_O.shape == (Lyr, H, d, D)
    assert model.W_E.shape == (cfg.d_vocab, D) and model.W_U.shape == (D, cfg.d_vocab)
    assert model.W_in.shape == (Lyr, D, cfg.d_mlp) and model.W_out.shape == (Lyr, cfg.d_mlp, D)
    _, cache = model.run_with_cache(tokens)
    G = H // cfg.n_key_value_heads
    for layer, block in enumerate(model.blocks):
        x = block.ln1(cache[f"blocks.{layer}.hook_resid_pre"])  # what the attention reads
        q = torch.einsum("bnm,hmd->bnhd", x, model.W_Q[layer])
        assert torch.allclose(q, cache[f"blocks.{layer}.attn.hook_q"], atol=1e-5)
        for view, hook in ((model.W_K, "k"), (model.W_V, "v")):
            name_ = f"blocks.{layer}.attn.hook_{'kv' if block.attn.tied else hook}"
            kv = torch.einsum("bnm,hmd->bnhd", x, view[layer])  # [B, n, H, d]: KV heads repeated
            assert torch.allclose(kv, cache[name_].repeat_interleave(G, dim=2), atol=1e-5)
        out = torch.einsum("bnhd,hdm->bnm", cache[f"blocks.{layer}.attn.hook_z"], model.W_O[layer])
        assert torch.allclose(out, cache[f"blocks.{layer}.hook_attn_out"], atol=1e-5)
    assert torch.equal(cache["hook_embed"], model.W_E[tokens])
    logits = model.ln_final(cache[f"blocks.{Lyr - 1}.hook_resid_post"]) @ model.W_U
    assert torch.allclose(logits, model(tokens), atol=1e-5)


def test_adapter_hook_pattern_explains_the_split():
    from tests.support.deepseek import random_tokens, tiny_v4_model

    adapter = phaselens.from_hf(tiny_v4_model())
    toks = random_tokens(1, 17, seed=0)
    with pytest.raises(HookNameError) as err:
        adapter.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: None)])
    msg = str(err.value)
    assert "compressed layer" in msg and all(s in msg for s in ("_local", "_entry", "_sink"))
    with pytest.raises(KeyError, match="sliding-window layer"):  # layer 0 slides: local and sink only
        adapter.hook_dict["blocks.0.attn.hook_pattern"]
    with torch.no_grad():
        _, cache = adapter.run_with_cache(toks, names_filter=lambda n: "hook_pattern" in n)
    for layer in range(4):
        comb = phaselens.contract.hooknames.combined_pattern(cache, layer)
        assert torch.allclose(comb.sum(-1), torch.ones_like(comb[..., 0]), atol=1e-5)
