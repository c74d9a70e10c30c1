"""The head knockout map of a transformers causal LM at ~1K tokens: the query-suffix engine against full forwards.

Both sides run ``phaselens.specialization_map`` on the same items (``engine="suffix"`` and ``engine="full"``,
head and whole-layer cells, zero knockout, no bootstrap): the full engine runs one hooked forward over every
item per cell; the suffix engine prefills each query slot's prefix once into the model's own ``DynamicCache``
and runs only the query rows per cell, from the knocked-out layer up, many cells per pass.

**The physical limit** is what any exact method must at least do with this model: one forward over the prefix
(with its cache) plus, per cell, one pass of the query rows through the layers at and above the knocked-out
one (measured with the engine's own pass on a single cell, so without the batching over cells that the engine
does). The engine can beat it (ratio below 1) because it batches cells.

    .venv/bin/python -m benchmarks.bench_causal_map [--n-per-residue 1] [--models llama qwen3]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

import phaselens
from benchmarks.common import best_time, emit
from phaselens.contract.cells import Cell
from phaselens.tasks import KVRecall

TASK = KVRecall(n_records=32, block_filler=430, modulus=8, n_demos=4)  # 1,023 tokens per item


def tiny(kind: str, vocab: int):
    """A 4-layer, 8-head (4 KV heads) model of ``kind`` built from a config (random weights, fp32)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16)).eval()


def measure(model, batch) -> dict:
    opts = dict(method="zero", kinds=("head", "layer"), n_bootstrap=0, progress=False)
    maps: dict = {}

    def run(engine: str) -> None:
        maps[engine] = phaselens.specialization_map(model, batch, engine=engine, **opts)

    t_suffix = best_time(lambda: run("suffix"), 3)
    t_full = best_time(lambda: run("full"), 1)  # minutes: once
    diff = float(np.abs(maps["suffix"].logit_diff_ko - maps["full"].logit_diff_ko).max())

    q = int(batch.query_pos[0])
    hf = model.model
    L, H = model.dims.n_layers, model.dims.n_heads

    @torch.no_grad()
    def prefix() -> None:
        from transformers import DynamicCache

        hf(input_ids=batch.tokens[:, :q], cache=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1)

    eng = model.query_engine(batch.tokens, batch.query_pos)
    per_layer = [best_time(lambda layer=layer: eng.run([Cell(layer, [0], None)]), 5) for layer in range(L)]
    cells = [layer for layer in range(L) for _ in range(H)] + list(range(L))  # head cells, then whole layers
    limit = best_time(prefix, 3) + sum(per_layer[layer] for layer in cells)
    return {"cells": len(cells), "items": len(batch), "tokens": int(batch.tokens.shape[1]),
            "full_forwards_s": t_full, "suffix_s": t_suffix, "speedup": t_full / t_suffix,
            "physical_limit_s": limit, "suffix_over_limit": t_suffix / limit,
            "max_abs_diff_logit_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-per-residue", type=int, default=1)
    ap.add_argument("--models", nargs="+", default=["llama", "qwen3"], choices=["llama", "qwen3"])
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    out: dict = {}
    t0 = time.time()
    for kind in args.models:
        model = phaselens.load(tiny(kind, TASK.vocab_size), stride=4)
        batch = TASK.build(model.analysis_spec, n_per_residue=args.n_per_residue, seed=0)
        out[kind] = {"config": "4 layers x 8 heads (4 KV), d_model 128, fp32, SDPA", **measure(model, batch)}
    out["wall_s"] = time.time() - t0
    emit("bench_causal_map", out)


if __name__ == "__main__":
    main()
