"""Per-head knockout cells on a tiny DeepSeek-V4.1: the query-suffix engine against one full forward per cell.

The model is the test suite's tiny V4.1 checkpoint with Engram (``tests/support/deepseek_v41.py``: 7 layers,
sliding, ratio-2 and ratio-1 compressed layers, shared entries and picks, the candidate filter), fp32,
``index_topk="all"``, prefilled in chunks of 256 (context raised to 16K). The items are 8 random sequences of ``tokens`` tokens sharing
the query slot (the last); the cells are every single-head zero knockout (7 layers x 4 heads = 28).

Reported per length, measured side by side in one process:

* ``engine_s``: building the engine (the clean prefix once, the clean query step) plus every cell's pass;
  ``engine_build_s`` of it is the build;
* ``full_s``: one full forward per cell with the knockout hook (the reference way): ``--full-cells`` cells
  spread over the layers are run (``full_cells_run``; 0 runs every cell) and their mean times the cells;
* ``speedup``: ``full_s / engine_s``; ``forward_over_marginal``: one full forward against the engine's
  marginal cost per cell (``(engine_s - engine_build_s) / cells``);
* ``physical_limit_s``: one full forward plus, per cell, one query-row pass alone from the cell's layer
  (best of 3 on the built engine); ``map_over_limit``: ``engine_s`` against it;
* ``max_abs_diff``: the largest logit difference between the two ways over the cells run both ways.

Times are CPU seconds of the process on the CPU (one thread), wall seconds after a synchronize on CUDA.

    nice -n 15 .venv/bin/python -m benchmarks.bench_v41_maps [--lengths 1024 4096] [--device cuda]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import emit

N_ITEMS = 8


def build(root: Path, device: str):
    from phaselens.models.deepseek_v41 import load_v41
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(root / "tiny", engram=True, max_position_embeddings=16384)
    return load_v41(ckpt, dtype=torch.float32, index_topk="all", chunk=256, device=device)


def clock(device: str) -> float:
    """CPU seconds of this process on the CPU (other processes' load does not inflate them); wall seconds after
    a synchronize on CUDA (the GPU's work is not this process's CPU time)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def one_length(model, tokens: int, device: str, full_cells: int | None) -> dict:
    from phaselens.contract.cells import Cell
    from phaselens.models.deepseek_v41.engine import V41SuffixEngine

    ids = torch.randint(3, model.cfg.d_vocab, (N_ITEMS, tokens), generator=torch.Generator().manual_seed(tokens))
    ids = ids.to(device)
    q = tokens - 1
    cells = [Cell(layer, [h], None) for layer in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    with torch.no_grad():
        c0 = clock(device)
        engine = V41SuffixEngine(model, ids, q)
        build_s = clock(device) - c0
        fast = engine.run(cells)
        engine_s = clock(device) - c0

        def knockout(cell):
            def hook(z, hook):
                z = z.clone()
                z[:, -1, list(cell.heads)] = 0
                return z
            return hook

        checked = cells if full_cells is None else cells[:: max(1, len(cells) // full_cells)][:full_cells]
        c0 = clock(device)
        slow = torch.stack([model.run_with_hooks(ids, fwd_hooks=[(f"blocks.{c.layer}.attn.hook_z", knockout(c))])[:, q]
                            for c in checked])
        measured_s = clock(device) - c0
        forward_s = measured_s / len(checked)
        lone = {}  # one cell's query-row pass from each layer, alone (best of 3)
        for layer in range(model.cfg.n_layers):
            times = []
            for _ in range(3):
                c0 = clock(device)
                engine.run([Cell(layer, [0], None)])
                times.append(clock(device) - c0)
            lone[layer] = min(times)
    index = [cells.index(c) for c in checked]
    limit = forward_s + sum(lone[c.layer] for c in cells)
    full_s = forward_s * len(cells)
    marginal = (engine_s - build_s) / len(cells)
    return {"tokens": tokens, "cells": len(cells), "items": N_ITEMS, "engine_s": engine_s, "engine_build_s": build_s,
            "full_cells_run": len(checked), "full_s": full_s, "speedup": full_s / engine_s, "forward_s": forward_s,
            "forward_over_marginal": forward_s / marginal, "physical_limit_s": limit, "map_over_limit": engine_s / limit,
            "max_abs_diff": float((fast[index] - slow).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full-cells", type=int, default=4,
                        help="cells run as full forwards (spread over the layers; the full map is their mean "
                             "times the cells); 0: every cell")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp), args.device)
        rows = [one_length(model, n, args.device, args.full_cells or None) for n in args.lengths]
    goal = next((r for r in rows if r["tokens"] >= 900), None)
    emit("bench_v41_maps", {"model": "tiny V4.1 with Engram (7 layers x 4 heads, fp32, index_topk=all, chunk 256)",
                            "device": args.device, "rows": rows,
                            "goal_10x_at_900": None if goal is None else goal["speedup"] >= 10,
                            "goal_within_2x_of_limit": all(r["map_over_limit"] <= 2 for r in rows)})


if __name__ == "__main__":
    main()
