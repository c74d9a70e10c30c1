"""record() (every head, read and write side) against a plain forward over the same items.

    .venv/bin/python -m benchmarks.bench_record [--model w8s4] [--n-per-residue 32] [--repeats 25]
"""

from __future__ import annotations

import argparse

import torch

import phaselens
from benchmarks.common import emit, interleaved_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="w8s4")
    ap.add_argument("--n-per-residue", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=25, help="turns of each side; the best of each is kept")
    args = ap.parse_args()
    model = phaselens.load(f"zoo:{args.model}")
    batch = model.default_task.build(model.analysis_spec, n_per_residue=args.n_per_residue, seed=0)
    bs = args.batch_size

    @torch.no_grad()
    def plain() -> None:
        for i in range(0, len(batch), bs):
            model(batch.tokens[i : i + bs])

    def rec() -> None:
        phaselens.record(model, batch, batch_size=bs, progress=False)

    plain()  # warm-up
    t = interleaved_times({"plain": plain, "record": rec}, args.repeats)
    t_plain, t_rec = t["plain"], t["record"]
    emit("bench_record", {"model": args.model, "items": len(batch), "plain_forward_s": t_plain, "record_s": t_rec,
                          "record_over_plain": t_rec / t_plain, "repeats": args.repeats})


if __name__ == "__main__":
    main()
