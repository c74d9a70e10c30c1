"""The family's backbone is Qwen3: with compression off, the same weights in transformers' ``Qwen3ForCausalLM``
and in phaselens give the same fp32 logits (the issue's bound: 1e-5, relative to the logits' scale)."""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.errors import ConfigError
from phaselens.models import CompressorSpec
from phaselens.models.compressed.qwen3 import from_qwen3, qwen3_config, to_qwen3
from phaselens.train.family.recipes import family_config

TOL = 1e-5


def tiny_qwen3(tie: bool, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tie,
                      attn_implementation="eager")
    hf = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # a trained model's scales: norms away from 1, a residual that dominates
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.mul_(8.0)
    return hf


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("tie", [True, False])
def test_qwen3_weights_give_qwen3_logits(tie):
    hf = tiny_qwen3(tie)
    model = from_qwen3(hf)
    tokens = torch.randint(0, 97, (3, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = model(tokens)
    assert ref.abs().max() > 3  # logits of a trained scale (several units), so the bound means something
    assert rel_max(got, ref) <= TOL
    # and back: phaselens's weights written into transformers' model give the same logits
    with torch.no_grad():
        again = to_qwen3(model)(tokens).logits
    assert rel_max(again, got) <= TOL


def test_the_family_control_is_qwen3():
    """The family's full-attention member at a tiny size, loaded into transformers, gives its logits."""
    model = phaselens.models.CompressedTransformer(family_config("full", "tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 120), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(tokens)
        ref = to_qwen3(model)(tokens).logits
    assert rel_max(got, ref) <= TOL
    # the same backbone with compressors differs (its compressed layers see entries, not every token)
    comp = family_config("w4s4", "tiny")
    assert qwen3_config(to_qwen3(model).config, compression=comp.compression).compression == comp.compression


def test_saved_and_loaded_with_tied_embeddings(tmp_path):
    model = phaselens.models.CompressedTransformer(family_config("w8s4", "tiny"))
    assert model.unembed.weight is model.embed.weight
    model.save(tmp_path / "m")
    back = phaselens.load(tmp_path / "m")
    assert back.unembed.weight is back.embed.weight
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 60))
    with torch.no_grad():
        assert torch.equal(model(tokens), back(tokens))


def test_conversion_refuses_what_it_cannot_write():
    model = phaselens.models.CompressedTransformer(family_config("w4s4", "tiny"))
    with pytest.raises(ConfigError, match="full-attention"):
        to_qwen3(model)
    hf = tiny_qwen3(True)
    with pytest.raises(ConfigError, match="tied K=V"):
        from_qwen3(hf, compression=CompressorSpec(4, tied_kv=True))
    with pytest.raises(ConfigError, match="attention biases"):
        qwen3_config({**hf.config.to_dict(), "attention_bias": True})


def test_compressed_qwen3_keeps_the_backbone_weights():
    """from_qwen3 with a compressor that pools the layer's own keys and values (payload='attention', the
    family's) copies every weight and adds only the gates; until the first entry completes, and while every
    raw token lies in the local window, the logits are Qwen3's."""
    hf = tiny_qwen3(True)
    model = from_qwen3(hf, compression=CompressorSpec(4, payload="attention"), local_window=16)
    gates = sum(p.numel() for name, p in model.named_parameters() if "compressor" in name)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()) + gates
    assert gates == 3 * 2 * (64 * 2 + 4 * 2)  # layers x (K, V) x (gate projection + per-offset bias), 2 KV heads
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = hf(tokens).logits, model(tokens)
    # position 0..2 see no complete entry and all their raw tokens lie in the window: Qwen3's exact logits
    assert rel_max(got[:, :3], ref[:, :3]) <= TOL
    assert rel_max(got[:, 20:], ref[:, 20:]) > 1e-3


def test_the_family_cache_is_a_real_cache():
    """Prefill plus token-by-token decoding through the compressed cache gives the parallel forward's logits
    on the family's backbone (QK-norm, GQA, 'half' RoPE, overlapping windows)."""
    model = phaselens.models.CompressedTransformer(family_config("w8s4", "tiny", seed=1))
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 45), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(tokens)
        cache = model.new_cache(2, 45)
        first = model(tokens[:, :13], cache=cache)
        steps = [model(tokens[:, t : t + 1], cache=cache) for t in range(13, 45)]
    got = torch.cat([first, *steps], dim=1)
    assert rel_max(got, ref) <= TOL
