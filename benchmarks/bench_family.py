"""The family's backbone against transformers' own Qwen3, side by side: a training step and a forward on CPU.

phaselens trains the paper's family on its own ``CompressedTransformer`` (eager attention, so that every hook
sees the probabilities). The reference way is transformers' ``Qwen3ForCausalLM`` with the same weights
(``to_qwen3``): eager attention (the same arithmetic) and SDPA (a fused kernel, no probabilities). Also the
stride-4 member against the control (what the compressors cost). Each side runs in turns, best of
``--repeats``. Prints one JSON document.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.bench_family [--size small] [--batch 8] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import emit, interleaved_times
from phaselens.models import CompressedTransformer
from phaselens.models.compressed.qwen3 import to_qwen3
from phaselens.train.family.recipes import family_config, paper_task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    n = paper_task().seq_len()
    full = CompressedTransformer(family_config("full", args.size)).train()
    w4s4 = CompressedTransformer(family_config("w4s4", args.size)).train()
    hf_eager = to_qwen3(full).train()
    hf_sdpa = to_qwen3(full).train()
    hf_sdpa.config._attn_implementation = "sdpa"  # same weights, transformers' fused attention
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, full.config.d_vocab, (args.batch, n), generator=gen)
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]  # next-token loss at every position, as transformers' labels= computes it

    def ours(model: CompressedTransformer, backward: bool):
        def step():
            with torch.set_grad_enabled(backward):
                loss = model(tokens, targets=targets, return_type="loss")
                if backward:
                    loss.backward()
                    model.zero_grad(set_to_none=True)
        return step

    def theirs(model, backward: bool):
        def step():
            with torch.set_grad_enabled(backward):
                loss = model(input_ids=tokens, labels=tokens).loss
                if backward:
                    loss.backward()
                    model.zero_grad(set_to_none=True)
        return step

    with torch.no_grad():  # the same function before timing it
        a = full(tokens, targets=targets, return_type="loss")
        b = hf_eager(input_ids=tokens, labels=tokens).loss
    out: dict = {"size": args.size, "parameters": sum(p.numel() for p in full.parameters()), "batch": args.batch,
                 "tokens_per_sequence": n, "loss_phaselens": float(a), "loss_transformers": float(b)}
    for backward in (True, False):
        t = interleaved_times({"phaselens_full": ours(full, backward), "phaselens_w4s4": ours(w4s4, backward),
                               "transformers_eager": theirs(hf_eager, backward),
                               "transformers_sdpa": theirs(hf_sdpa, backward)}, repeats=args.repeats)
        key = "train_step" if backward else "forward"
        out[key] = {"seconds": t, "tokens_per_s": {k: args.batch * n / v for k, v in t.items()},
                    "phaselens_full_over_transformers_eager": t["phaselens_full"] / t["transformers_eager"],
                    "phaselens_full_over_transformers_sdpa": t["phaselens_full"] / t["transformers_sdpa"],
                    "w4s4_over_full": t["phaselens_w4s4"] / t["phaselens_full"]}
    emit("bench_family", out)


if __name__ == "__main__":
    main()
