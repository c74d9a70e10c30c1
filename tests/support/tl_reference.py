"""Same-weights TransformerLens references for the TransformerLens-surface tests (issue 46): a tiny random fp64
transformers model, phaselens' adapter over it, and a ``TransformerBridge`` over a deep copy (the bridge rewires the
module it wraps, so it never sees the adapter's object)."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch

import phaselens
from tests.support.causal_lm import tiny_causal_lm

ARCHITECTURE = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM"}


def perturb_(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Move every norm gain and bias off its initial 1 / 0, so a test that forgets one of them fails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def bridge_over(hf: torch.nn.Module, arch: str) -> Any:
    """A ``TransformerBridge`` over a deep copy of ``hf`` (no tokenizer, no download)."""
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    os.environ["HF_HUB_OFFLINE"] = "1"
    twin = copy.deepcopy(hf).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = build_bridge_from_module(twin, ARCHITECTURE[arch], hf_config=twin.config, tokenizer=None,
                                          device="cpu")
    return bridge.eval()


def pair(arch: str, *, seed: int = 0) -> tuple[Any, Any, torch.Tensor]:
    """``(phaselens adapter, TransformerLens bridge, tokens [2, 7])`` over the same fp64 weights."""
    hf = perturb_(tiny_causal_lm(arch, seed=seed).double()).eval()
    model = phaselens.load(hf, stride=4)
    ref = bridge_over(hf, arch)
    tokens = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(seed))
    return model, ref, tokens


def tiny_mixtral() -> Any:
    """A tiny random Mixtral (a mixture-of-experts MLP) adapted at stride 4: TransformerLens has no neurons there."""
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return phaselens.load(tf.MixtralForCausalLM(cfg).eval(), stride=4)
