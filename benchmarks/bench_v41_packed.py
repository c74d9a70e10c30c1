"""DeepSeek-V4.1 with packed FP8 / FP4 weights (dequantized inside the forward) against weights dequantized at
load: memory and tokens per second, side by side, on the CPU.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_v41_packed [--experts 64] [--ff 256] [--tokens 256]

A tiny random V4.1 checkpoint in the release's formats (``tests/support/deepseek_v41.py``: 7 layers of every kind),
with routed experts dominating its size as in the release (64 experts of d_ff 256 by default). Both models
load the same files in bf16 and produce the same logits (checked here). Reported: the weights' bytes as
held, the load time, prefill tokens/s (one forward over ``--tokens`` tokens) and decoding tokens/s (one
token per call through the cache after a 64-token prefill), best of interleaved turns. Times are **CPU
seconds** of this process on one thread (``time.process_time``): other processes' load on a shared machine
inflates wall time, not CPU time (wall seconds are in the JSON too).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import emit
from phaselens.models.deepseek_v41 import load_v41
from tests.support.deepseek_v41 import write_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "v41", seed=0, n_routed_experts=args.experts,
                                     moe_intermediate_size=args.ff)
        files = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        models, load_s = {}, {}
        load_v41(ckpt, dtype=torch.bfloat16)  # warm-up: first-call imports and torch's lazy set-up
        for weights in ("packed", "dequantized"):
            t0 = time.perf_counter()
            models[weights] = load_v41(ckpt, dtype=torch.bfloat16, index_topk="all", weights=weights)
            load_s[weights] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (1, args.tokens), generator=g)
    prompt = torch.randint(0, 128, (1, 64), generator=g)
    steps = torch.randint(0, 128, (1, args.decode), generator=g)

    def prefill(m) -> tuple[float, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        m(x, logits="query", query_len=1)
        return time.process_time() - c0, time.perf_counter() - w0

    def decode(m) -> tuple[float, float]:
        cache = m.new_cache(1)
        m(prompt, cache=cache, logits="query", query_len=1)
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(args.decode):
            m(steps[:, i : i + 1], cache=cache)
        return time.process_time() - c0, time.perf_counter() - w0

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    pre = {k: (float("inf"), float("inf")) for k in models}
    dec = dict(pre)
    with torch.no_grad():
        same = torch.equal(models["packed"](x), models["dequantized"](x))
        for _ in range(args.repeats):  # in turns (a, b, a, b, ...), the best of each
            for k, m in models.items():
                pre[k] = min(pre[k], prefill(m))
                dec[k] = min(dec[k], decode(m))
    held = {k: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) for k, m in models.items()}
    rows = [{"weights": k, "weights_MiB": held[k] / 2**20, "load_s": load_s[k],
             "prefill_tokens_per_s": args.tokens / pre[k][0], "decode_tokens_per_s": args.decode / dec[k][0],
             "prefill_wall_s": pre[k][1], "decode_wall_s": dec[k][1]} for k in models]
    emit("bench_v41_packed", {
        "experts": args.experts, "d_ff": args.ff, "tokens": args.tokens, "decode_steps": args.decode,
        "files_MiB": files / 2**20, "logits_identical": same, "rows": rows, "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "packed_over_dequantized": {
            "weights_bytes": held["packed"] / held["dequantized"],
            "prefill_speed": pre["dequantized"][0] / pre["packed"][0],
            "decode_speed": dec["dequantized"][0] / dec["packed"][0],
        },
    })


if __name__ == "__main__":
    main()
