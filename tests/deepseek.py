"""Tiny random transformers DeepSeek-V4 models, built in-test (no downloads)."""

from __future__ import annotations

import warnings

import torch

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


def tiny_v4_config(**overrides):
    from transformers import DeepseekV4Config

    kwargs = dict(
        vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, layer_types=list(LAYER_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=64,
        max_position_embeddings=65536 * 16,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            # As in the released Flash config: YaRN on the compressed path (θ 160000, factor 16).
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                         "original_max_position_embeddings": 65536, "partial_rotary_factor": 0.25},
        },
    )
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = DeepseekV4Config(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_v4_model(seed: int = 0, **overrides):
    """A random eager DeepSeek-V4 with ``position_bias`` and ``sinks`` re-drawn from N(0, 0.5)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_v4_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    return model
