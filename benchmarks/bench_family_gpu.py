"""The paper family at its real size on one GPU: tokens/s and peak memory of the 0.6b size, as JSON.

Run from the repository root on a CUDA machine (one GPU; under 4 minutes with start-up)::

    python -m benchmarks.bench_family_gpu --budget 150 > family_gpu.json

Each phase stops at its share of ``--budget`` seconds (``train_family(time_limit=...)``), then writes one
checkpoint (7.9 GB at 0.6b, removed after the phase), so the whole script takes about the budget plus imports
and checkpoint writes.

Phases (each a real ``phaselens.train.family.trainer.train_family`` run, bf16 autocast, AdamW, the paper's task):

1. ``paper-w4s4`` (stride 4 compressors in every layer), activation recompute on: 20 steps, then the run
   is *resumed* from its step-20 checkpoint and trained as many more steps as its share of the budget allows
   (up to 300 in all): the steady-state tokens/s comes from the resumed part, so start-up is excluded.
2. ``paper-full`` (Qwen3-0.6B itself), same settings, a shorter run: full attention for comparison.
3. ``paper-w4s4`` with a quarter of each batch cut from pretraining tokens (a synthetic random-id file written
   here: every position of those rows is trained, so the 151,936-way logits are computed on every token).
4. ``paper-w4s4`` without activation recompute, a few steps: the memory it saves.

Each phase prints tokens/s, seconds per step, peak allocated memory, the plan's memory estimate for one GPU
(``phaselens.train.family.training_plan``), the model-FLOPs utilisation (``mfu``: the plan's model FLOPs per token,
``phaselens.train.family.costs.flops_per_token``, times tokens/s over the peak of ``--peak-tflops``) and the
hardware-FLOPs utilisation (``hfu``: the same with activation recompute). The data warm-up is
off, so every step trains the paper task's 351-token rows.
Needs: torch with CUDA (2.11 works), phaselens's requirements (transformer_lens, safetensors, jaxtyping); no
network, nothing downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def phase(name: str, recipe_name: str, *, batch: int, micro: int, max_steps: int, ac: bool, ratio: float,
          tokens_file: Path | None, root: Path, budget_s: float, resume_part: bool) -> dict:
    import shutil

    from phaselens.train.family.data import TokenFiles
    from phaselens.train.family.recipes import family_recipe
    from phaselens.train.family.run import family_data
    from phaselens.train.family.trainer import Parallelism, read_log, train_family
    from phaselens.train.family.training_plan import plan_run

    # a long schedule that every phase stops early (time limit or max_steps): no final gather, one
    # checkpoint per stop (the 0.6b state is 7.9 GB: weights and AdamW's two moments in fp32)
    recipe = family_recipe(recipe_name, ARGS.size, steps=10**6, batch_size=batch)
    # no data warm-up: every step trains the paper task's 351-token rows, which are 99.7% of a 0.6b run's tokens
    # (the warm-up's 147-token rows would be counted as 351 in tokens_per_step)
    recipe = dataclasses.replace(recipe, warmup_steps=0, settings=dataclasses.replace(
        recipe.settings, warmup=10, checkpoint_every=10**9, eval_every=10**9, threads=None))
    data = family_data(recipe, TokenFiles((str(tokens_file),)) if ratio else None, ratio)
    par = Parallelism(precision="bf16", recompute_activations=ac, micro_batch=micro)
    run_dir = root / name
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first = 20 if resume_part else max_steps
    train_family(recipe.config, data, recipe.settings, run_dir, parallel=par, progress=False, stop_after=first,
                 time_limit=budget_s * (0.4 if resume_part else 0.75), peak_tflops=ARGS.peak_tflops)
    first_wall = time.perf_counter() - t0
    log = read_log(run_dir)
    done, resume_wall = log["step"][-1], None
    if resume_part and done == first:  # resume from the checkpoint and train on within the budget
        t1 = time.perf_counter()
        left = budget_s - (t1 - t0)
        if left > 10:
            train_family(recipe.config, data, recipe.settings, run_dir, parallel=par, progress=False,
                         stop_after=max_steps, time_limit=left * 0.7, peak_tflops=ARGS.peak_tflops)
            resume_wall = time.perf_counter() - t1
            log = read_log(run_dir)
            done = log["step"][-1]
    from phaselens.train.metrics import read_metrics

    interval = read_metrics(run_dir)  # the trainer's own interval records (loss, grad norm, MFU, peak memory)
    shutil.rmtree(run_dir, ignore_errors=True)
    s = np.asarray(log["seconds"])
    k = first if done > first + 2 else min(5, len(s) - 2)  # steady state: the resumed part, or after warm-up
    secs = (s[-1] - s[k]) / (len(s) - 1 - k)
    tok_s = recipe.tokens_per_step / secs
    plan = plan_run(recipe, gpus=1, micro_batch=micro, recompute_activations=ac, pretrain_ratio=ratio)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"phase": name, "recipe": recipe_name, "size": ARGS.size, "parameters": plan.parameters, "steps": done,
            "steady_steps": len(s) - 1 - k, "batch_size": batch, "micro_batch": micro, "seq_len": recipe.seq_len,
            "tokens_per_step": recipe.tokens_per_step, "recompute_activations": ac, "pretrain_ratio": ratio,
            "precision": "bf16", "seconds_per_step": secs, "tokens_per_second": tok_s,
            "flops_per_token": plan.per_token.to_dict(),
            "mfu": plan.per_token.model * tok_s / (ARGS.peak_tflops * 1e12),
            "hfu": plan.per_token.executed * tok_s / (ARGS.peak_tflops * 1e12),
            "plan_needs_recompute_80gb": plan.needs_recompute,
            "peak_allocated_gib": peak,
            "plan_estimate_gib": plan.memory_per_gpu / 2**30,
            "plan_memory_gib": {key: v / 2**30 for key, v in plan.memory.items()},
            "trainer_metrics_last": interval[-1] if interval else None,
            "first_part_wall_s": first_wall, "resumed_part_wall_s": resume_wall,
            "loss_first": log["loss"][0], "loss_last": log["loss"][-1]}


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the phases (imports excluded)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--size", default="0.6b", help="family size (tiny: a CPU smoke test of this script)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (smoke test)")
    ARGS = ap.parse_args()
    if not torch.cuda.is_available() and not ARGS.allow_cpu:
        print(json.dumps({"benchmark": "family_gpu", "error": "no CUDA device"}))
        return
    t_start = time.perf_counter()
    from phaselens.train.family.recipes import family_config

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    out = {"benchmark": "family_gpu", "torch": torch.__version__, "gpu": gpu,
           "machine": platform.machine(), "phases": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokens = root / "tokens.npy"
        vocab = family_config("full", ARGS.size).d_vocab
        np.save(tokens, np.random.default_rng(0).integers(0, vocab, 4_000_000, dtype=np.int64).astype(np.uint32))
        plan = [("w4s4", "paper-w4s4", dict(max_steps=300, ac=True, ratio=0.0, resume_part=True), 0.46),
                ("full", "paper-full", dict(max_steps=100, ac=True, ratio=0.0, resume_part=False), 0.18),
                ("w4s4-pretrain", "paper-w4s4", dict(max_steps=60, ac=True, ratio=0.25, resume_part=False), 0.18),
                ("w4s4-no-ac", "paper-w4s4", dict(max_steps=40, ac=False, ratio=0.0, resume_part=False), 0.18)]
        for name, recipe, kw, share in plan:
            left = ARGS.budget - (time.perf_counter() - t_start)
            if left < 15:
                out["phases"].append({"phase": name, "skipped": "time budget spent"})
                continue
            try:
                out["phases"].append(phase(name, recipe, batch=ARGS.batch, micro=ARGS.micro, tokens_file=tokens,
                                           root=root, budget_s=min(left, share * ARGS.budget), **kw))
            except torch.OutOfMemoryError as err:
                out["phases"].append({"phase": name, "error": f"out of memory: {str(err)[:200]}"})
            import gc

            gc.collect()  # the phase's model and optimizer, before the next phase measures its peak
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    out["total_seconds"] = time.perf_counter() - t_start
    print(json.dumps(out, indent=2, default=float))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
