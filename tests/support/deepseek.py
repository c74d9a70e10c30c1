"""Tiny random transformers DeepSeek-V4 models, built in-test (no downloads); helpers the adapter tests share.

A test module opts into the single-thread fixture by importing it (``from tests.support.deepseek import one_thread``):
pytest picks up fixtures from a module's namespace.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch

VOCAB = 1000

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


def tiny_v4_config(**overrides):
    """A 4-layer V4 config (sliding, CSA 4, HCA 16, CSA 4); ``overrides`` replace any field. RoPE rotates the
    trailing ``head_dim * partial_rotary_factor`` channels (16 by default) on both paths."""
    from transformers import DeepseekV4Config

    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, layer_types=list(LAYER_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=64,
        max_position_embeddings=65536 * 16, partial_rotary_factor=0.25,
    )
    kwargs.update(overrides)
    prf = kwargs["partial_rotary_factor"]  # qk_rope_head_dim agrees with what the rotary embeddings rotate
    kwargs.setdefault("rope_parameters", {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf},
        # The compressed path as DeepSeek's reference computes it: YaRN frequencies (θ 160000, factor 16
        # from 65,536) and no magnitude scaling. A nested dict must say attention_factor 1.0 itself:
        # transformers injects it only when it builds the nesting from a flat rope_scaling (as it does for
        # the released config.json files); left out, cos/sin are scaled by 0.1 ln 16 + 1 ≈ 1.277.
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                     "original_max_position_embeddings": 65536, "partial_rotary_factor": prf,
                     "attention_factor": 1.0},
    })
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = DeepseekV4Config(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


# The smallest sizes DeepSeek's quantization blocks admit: 64 non-RoPE dims (80 - 16), a 32-dim indexer.
QUANTIZABLE = dict(head_dim=80, partial_rotary_factor=0.2, index_head_dim=32)


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


def tiny_v4_fp64(seed: int = 0, **overrides):
    """:func:`tiny_v4_model` in fp64, its experts run one by one (transformers' default ``grouped_mm`` takes no
    fp64): for exact comparisons of two paths, which a top-k pick or the router could flip in fp32."""
    model = tiny_v4_model(seed, **overrides).double()
    model.config._experts_implementation = "eager"
    return model


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The tiny model is faster on one thread, and far faster on a busy machine (no OpenMP spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_tokens(batch: int, length: int, seed: int | torch.Generator) -> torch.Tensor:
    """Token ids ``[batch, length]`` in ``[0, VOCAB)``; a Generator draws several batches from one stream."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def attention_modules(adapter) -> dict[int, torch.nn.Module]:
    """``{layer: self_attn}`` of the wrapped transformers model."""
    return {i: layer.self_attn for i, layer in enumerate(adapter.model.model.layers)}


def compressor_modules(adapter) -> dict[int, torch.nn.Module]:
    """``{layer: compressor}`` of the layers that have one (not the sliding-window layers)."""
    comps = {i: layer.self_attn.compressor for i, layer in enumerate(adapter.model.model.layers)}
    return {i: comp for i, comp in comps.items() if comp is not None}


def run_capturing(
    adapter: Callable[..., torch.Tensor],
    tokens: torch.Tensor,
    modules: Mapping[int, torch.nn.Module],
    keep: Callable[[tuple, Any], Any] = lambda args, out: (args, out),
    **kwargs,
) -> tuple[torch.Tensor, dict[int, list]]:
    """``adapter(tokens, **kwargs)`` without grad, with a forward hook on each of ``modules``.

    Returns the logits and ``{key: [keep(args, output), ...]}``: every call of each module, in order (a
    chunked prefill calls a module once per chunk). ``keep`` picks what to hold on to (by default the inputs
    and the output; keep less where the tensors are large). The hooks are removed in ``finally``.
    """
    calls: dict[int, list] = {key: [] for key in modules}
    handles = [
        m.register_forward_hook(lambda m, args, out, key=key: calls[key].append(keep(args, out)))
        for key, m in modules.items()
    ]
    try:
        with torch.no_grad():
            logits = adapter(tokens, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return logits, calls


def tiny_v4_bf16(directory, seed: int = 0, embed_scale: float = 1.0, **overrides):
    """The tiny V4 saved to ``directory`` and loaded back in bf16, as ``from_pretrained`` loads a real
    checkpoint (norms, gates' position bias, sinks and hyper-connections stay fp32).

    ``embed_scale`` multiplies the embedding: at 50 the residual dominates the layers' outputs as in a trained
    model; at 1 a random V4 is chaotic in bf16 (a rounding flip anywhere changes the logits by percents)."""
    from transformers import DeepseekV4ForCausalLM

    model = tiny_v4_model(seed, **overrides)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DeepseekV4ForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, attn_implementation="eager"
        )
    return model.eval()


# ---- The released checkpoints' config.json (facts from the public copies; the weights are never needed) ----
# DeepSeek-V4-Flash(-Base): compress_ratios has one entry per layer plus one for the MTP layer (dropped by
# transformers); 0 = sliding window only, 4 = CSA, 128 = HCA.
FLASH_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}
# DeepSeek-V4-Pro(-Base): no sliding-only layer; HCA at 0-1, then CSA on even and HCA on odd layers to 60.
PRO_CONFIG: dict[str, Any] = {
    **FLASH_CONFIG, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "o_groups": 16, "index_topk": 1024, "moe_intermediate_size": 3072,
    "n_routed_experts": 384, "routed_scaling_factor": 2.5,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}


def released_config(facts: Mapping[str, Any], **overrides):
    """A transformers ``DeepseekV4Config`` from a released ``config.json`` (eager attention)."""
    from transformers import DeepseekV4Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = DeepseekV4Config(**{**facts, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def meta_v4(facts: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16, **overrides):
    """A released-size ``DeepseekV4ForCausalLM`` on the meta device (shapes and dtypes, no memory), with the
    dtypes ``from_pretrained(dtype=...)`` gives (norms, biases, sinks and hyper-connections in fp32)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DeepseekV4ForCausalLM._from_config(released_config(facts, **overrides), dtype=dtype).eval()
