"""Per-head knockout cells on a tiny DeepSeek-V4.1: the query-suffix engine against one full forward per cell.

The model is the test suite's tiny V4.1 checkpoint with Engram (``tests/support/deepseek_v41.py``: 7 layers,
sliding, ratio-2 and ratio-1 compressed layers, shared entries and picks, the candidate filter), fp32,
``index_topk="all"``, prefilled in chunks of 256. The items are 8 random sequences of ``tokens`` tokens sharing
the query slot (the last); the cells are every single-head zero knockout (7 layers x 4 heads = 28).

Reported per length, measured side by side in one process (CPU seconds, ``time.process_time``, one thread):

* ``engine_s``: building the engine (the clean prefix once, the clean query step) plus every cell's pass;
  ``engine_build_s`` of it is the build;
* ``full_s``: one full forward per cell with the knockout hook (the reference way), every cell run;
* ``speedup``: ``full_s / engine_s``; ``forward_over_marginal``: one full forward against the engine's
  marginal cost per cell (``(engine_s - engine_build_s) / cells``);
* ``max_abs_diff``: the largest logit difference between the two ways over every cell.

    nice -n 15 .venv/bin/python -m benchmarks.bench_v41_maps [--lengths 256 1024]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import emit

N_ITEMS = 8


def build(root: Path):
    from phaselens.models.deepseek_v41 import load_v41
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(root / "tiny", engram=True)
    return load_v41(ckpt, dtype=torch.float32, index_topk="all", chunk=256)


def one_length(model, tokens: int) -> dict:
    from phaselens.models.deepseek_v41.engine import V41SuffixEngine
    from phaselens.runtime.engines import Cell

    ids = torch.randint(3, model.cfg.d_vocab, (N_ITEMS, tokens), generator=torch.Generator().manual_seed(tokens))
    q = tokens - 1
    cells = [Cell(layer, [h], None) for layer in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    with torch.no_grad():
        c0 = time.process_time()
        engine = V41SuffixEngine(model, ids, q)
        build_s = time.process_time() - c0
        fast = engine.run(cells)
        engine_s = time.process_time() - c0

        def knockout(cell):
            def hook(z, hook):
                z = z.clone()
                z[:, -1, list(cell.heads)] = 0
                return z
            return hook

        c0 = time.process_time()
        slow = torch.stack([model.run_with_hooks(ids, fwd_hooks=[(f"blocks.{c.layer}.attn.hook_z", knockout(c))])[:, q]
                            for c in cells])
        full_s = time.process_time() - c0
    forward_s = full_s / len(cells)
    marginal = (engine_s - build_s) / len(cells)
    return {"tokens": tokens, "cells": len(cells), "items": N_ITEMS, "engine_s": engine_s, "engine_build_s": build_s,
            "full_s": full_s, "speedup": full_s / engine_s, "forward_s": forward_s,
            "forward_over_marginal": forward_s / marginal, "max_abs_diff": float((fast - slow).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp))
        rows = [one_length(model, n) for n in args.lengths]
    emit("bench_v41_maps", {"model": "tiny V4.1 with Engram (7 layers x 4 heads, fp32, index_topk=all, chunk 256)",
                            "rows": rows})


if __name__ == "__main__":
    main()
