"""Tiny models and tasks built in the tests (never downloaded)."""

from __future__ import annotations

import torch

from phaselens.models import CompressedConfig, CompressedTransformer, CompressorSpec

# Compressor layouts that tests sweep: (name, spec).
LAYOUTS = {
    "w4s4-scalar": CompressorSpec(4),
    "w8s4-deepseek": CompressorSpec(4, 8, gate="vector", overlap_split=True, tied_kv=True, norm=True),
    "w8s4-peroffset": CompressorSpec(4, 8, gate_params="per_offset", payload="per_offset"),
    "w6s3-uniform": CompressorSpec(3, 6, gate="uniform", position_bias=False),
    "w4s4-norope": CompressorSpec(4, rope="none"),
}


def make_model(compression: CompressorSpec | None = None, *, randomize: bool = True, **overrides) -> CompressedTransformer:
    """A tiny random model; gate biases and sinks are re-drawn so they are not trivially zero."""
    kwargs = dict(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_mlp=64, d_vocab=61, n_ctx=256,
        local_window=5, compression=compression, init_std=0.3, seed=3,
    )
    kwargs.update(overrides)
    model = CompressedTransformer(CompressedConfig(**kwargs))
    if randomize:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("position_bias") or name.endswith("sink"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def tiny_task(**overrides):
    """A short KVRecall (T ~ 60, M = 8) for mechanism tests on S = 4 models."""
    from phaselens.tasks import KVRecall

    kw = dict(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)
    kw.update(overrides)
    return KVRecall(**kw)


def task_model(compression=LAYOUTS["w4s4-scalar"], **overrides) -> CompressedTransformer:
    """A tiny random model sized for :func:`tiny_task`, with that task as its default."""
    task = tiny_task()
    kw = dict(d_vocab=task.vocab_size, n_ctx=128, local_window=4)
    kw.update(overrides)
    model = make_model(compression, **kw)
    model.default_task = task
    return model
