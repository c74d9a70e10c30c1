"""evaluate() throughput against plain batched forwards over the same tokens, side by side.

    .venv/bin/python -m benchmarks.bench_eval [--model w8s4] [--n-per-residue 64]
"""

from __future__ import annotations

import argparse

import torch

import phaselens
from benchmarks.common import best_time, emit, interleaved_times
from phaselens.analyses.scoring import score_items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="w8s4")
    ap.add_argument("--n-per-residue", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=128)
    args = ap.parse_args()
    model = phaselens.load(f"zoo:{args.model}")
    task = model.default_task
    batch = task.build(model.analysis_spec, n_per_residue=args.n_per_residue, seed=0)
    bs = args.batch_size

    @torch.no_grad()
    def plain() -> None:
        for i in range(0, len(batch), bs):
            model(batch.tokens[i : i + bs])

    def ours() -> None:  # the scoring pass of evaluate (the battery is statistics on top, timed separately)
        score_items(model, batch, batch_size=bs)

    def full_evaluate() -> None:
        phaselens.evaluate(model, n_per_residue=args.n_per_residue, batch_size=bs, progress=False)

    plain()  # warm-up
    t = interleaved_times({"plain": plain, "ours": ours})
    t_plain, t_ours, t_full = t["plain"], t["ours"], best_time(full_evaluate, repeats=2)
    emit("bench_eval", {"model": args.model, "items": len(batch), "tokens_per_item": batch.tokens.shape[1],
                        "plain_forward_s": t_plain, "evaluate_scoring_s": t_ours, "evaluate_with_battery_s": t_full,
                        "scoring_over_plain": t_ours / t_plain, "items_per_s": len(batch) / t_ours})


if __name__ == "__main__":
    main()
