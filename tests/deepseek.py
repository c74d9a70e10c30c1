"""Tiny random transformers DeepSeek-V4 models, built in-test (no downloads); helpers the adapter tests share.

A test module opts into the single-thread fixture by importing it (``from tests.deepseek import one_thread``):
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
    from transformers import DeepseekV4Config

    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
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
