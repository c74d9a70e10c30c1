"""The full layer x head x residue knockout map: the query-suffix engine against the TransformerLens way.

The baseline is the straightforward TransformerLens approach: one ``run_with_hooks`` forward over the whole
evaluation batch per (layer, head), mean-knocking out that head at the query position, with residues
separated afterwards from the per-item results. Both sides use the same items and calibration means.
The physical limit is one clean forward plus, per cell, the query-position pass through the layers at and
above the knocked-out one (measured with the engine's own per-layer pass on one cell).

    .venv/bin/python -m benchmarks.bench_maps [--skip-zoo]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import phaselens
from benchmarks.common import best_time, emit
from phaselens.analyses.knockouts import calibrate
from phaselens.analyses.scoring import answer_metrics
from phaselens.contract.cells import Cell
from phaselens.models import CompressedConfig, CompressedTransformer, CompressorSpec
from phaselens.models.compressed.engine import SuffixEngine
from phaselens.tasks import KVRecall


def measure(model, batch, cal) -> dict:
    L, H = model.cfg.n_layers, model.cfg.n_heads
    q = int(batch.query_pos[0])
    cells = [(layer, h) for layer in range(L) for h in range(H)]
    means = {layer: cal.mean(layer) for layer in range(L)}

    @torch.no_grad()
    def baseline() -> np.ndarray:
        out = []
        for layer, h in cells:
            def hook(z, hook, _h=h, _layer=layer):
                z = z.clone()
                z[:, q, _h] = means[_layer][_h]
                return z

            logits = model.run_with_hooks(batch.tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", hook)])[:, q]
            out.append(answer_metrics(logits, batch.answer, batch.wrong)["logit_diff"])
        return np.stack(out)

    def ours() -> np.ndarray:
        eng = SuffixEngine(model, batch.tokens, q)
        logits = eng.run([Cell(layer, [h], means[layer][[h]]) for layer, h in cells])
        return np.stack([answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"] for lg in logits])

    t_base = best_time(baseline, 2)
    t_ours = best_time(ours, 3)
    diff = float(np.abs(baseline() - ours()).max())

    @torch.no_grad()
    def clean() -> None:
        model(batch.tokens)

    eng = SuffixEngine(model, batch.tokens, q)
    per_layer = [best_time(lambda layer=layer: eng.run([Cell(layer, [0], means[layer][[0]])]), 5) for layer in range(L)]
    limit = best_time(clean, 3) + sum(per_layer[layer] for layer, _ in cells)
    return {"cells": len(cells), "items": len(batch), "tokens": batch.tokens.shape[1],
            "baseline_s": t_base, "ours_s": t_ours, "speedup": t_base / t_ours,
            "physical_limit_s": limit, "ours_over_limit": t_ours / limit, "max_abs_diff_logit_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-zoo", action="store_true")
    ap.add_argument("--n-per-residue", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    task = KVRecall(n_records=16, block_filler=16, padding="in_sequence", modulus=24)
    cfg = CompressedConfig(n_layers=4, d_model=128, n_heads=8, n_kv_heads=8, d_head=16, d_mlp=512,
                           d_vocab=task.vocab_size, n_ctx=256, local_window=8,
                           compression=CompressorSpec(4, 8, gate="vector", overlap_split=True, tied_kv=True, norm=True))
    model = CompressedTransformer(cfg)
    model.default_task = task
    batch = task.build(model.analysis_spec, n_per_residue=args.n_per_residue, seed=0)
    cal = calibrate(model, None, list(range(cfg.n_layers)), task=task)
    t0 = time.time()
    out = {"random_4x8": {"config": "4 layers x 8 heads, d_model 128, S=4 W=8 overlap_split", **measure(model, batch, cal)}}
    if not args.skip_zoo:
        zoo = phaselens.load("zoo:w8s4")
        zb = zoo.default_task.build(zoo.analysis_spec, n_per_residue=args.n_per_residue * 4, seed=0)
        out["zoo_w8s4"] = measure(zoo, zb, calibrate(zoo, None, list(range(zoo.cfg.n_layers))))
    out["wall_s"] = time.time() - t0
    emit("bench_maps", out)


if __name__ == "__main__":
    main()
