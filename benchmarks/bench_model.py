"""Forward, decode and cache-size benchmark: S=4 compressed model against its full-attention control.

Each (model, length) cell runs in a fresh subprocess so that its peak memory (ru_maxrss above the
baseline after building the model) is its own. Prefill goes through the cache in query chunks, so no
forward materialises an n x n matrix. Prints one JSON document.

    .venv/bin/python -m benchmarks.bench_model [--lengths 1024 4096 16384 32768] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

from phaselens.models import CompressedConfig, CompressedTransformer, CompressorSpec

DECODE_STEPS = 32


def build(kind: str, n_ctx: int) -> CompressedTransformer:
    comp = None if kind == "full" else CompressorSpec(4, 8, gate="vector", overlap_split=True, tied_kv=True, norm=True)
    cfg = CompressedConfig(n_layers=2, d_model=128, n_heads=4, d_head=32, d_mlp=512, d_vocab=512, n_ctx=n_ctx,
                           local_window=16, compression=comp)
    return CompressedTransformer(cfg)


def expected_cache_bytes(model: CompressedTransformer, length: int) -> int:
    """The layout formula (docs/benchmarks.md) that ``cache.nbytes()`` must match exactly."""
    cfg = model.config
    row = cfg.n_key_value_heads * cfg.d_head * 4
    if cfg.compression is None:
        return cfg.n_layers * length * row * 2
    S = cfg.compression.stride
    # tied K=V: one entry row per block, one raw row per window slot; open block holds Ca|Cb payload and
    # gate (2 groups x S x row each); the previous block keeps its Ca half (1 group x S x row each).
    return cfg.n_layers * ((length // S) * row + min(length, cfg.local_window - 1) * row + 2 * (2 * S * row) + 2 * (S * row))


def cell(kind: str, length: int, chunk: int) -> dict:
    torch.manual_seed(0)
    model = build(kind, length + DECODE_STEPS)
    tokens = torch.randint(0, 512, (1, length))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cache = model.new_cache(1, length + DECODE_STEPS)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model.prefill(tokens, cache, chunk=chunk)
        forward_s = time.perf_counter() - t0
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        nxt = logits.argmax(-1)
        steps = []
        for _ in range(DECODE_STEPS):
            t0 = time.perf_counter()
            nxt = model(nxt, cache=cache)[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - t0)
    measured_at = length + DECODE_STEPS
    return {
        "model": kind,
        "tokens": length,
        "forward_s": round(forward_s, 4),
        "forward_peak_mib": round(peak_mib, 1),
        "decode_step_ms": round(1000 * statistics.median(steps[4:]), 3),
        "cache_bytes": cache.nbytes(),
        "cache_bytes_formula": expected_cache_bytes(model, measured_at),
        "cache_bytes_match": cache.nbytes() == expected_cache_bytes(model, measured_at),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--cell", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(args.cell[0], int(args.cell[1]), args.chunk)))
        return
    rows = []
    for kind in ("compressed", "full"):
        for length in args.lengths:
            proc = subprocess.run(
                [sys.executable, __file__, "--cell", kind, str(length), "--chunk", str(args.chunk)],
                capture_output=True, text=True, timeout=3600,
            )
            if proc.returncode != 0:
                rows.append({"model": kind, "tokens": length, "error": proc.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(proc.stdout))
    comp = {r["tokens"]: r for r in rows if r["model"] == "compressed" and "error" not in r}
    full = {r["tokens"]: r for r in rows if r["model"] == "full" and "error" not in r}
    lo, hi = min(args.lengths), max(args.lengths)
    summary = {
        "decode_step_ratio_longest_vs_shortest_compressed": (
            round(comp[hi]["decode_step_ms"] / comp[lo]["decode_step_ms"], 3) if lo in comp and hi in comp else None
        ),
        "cache_bytes_ratio_full_over_compressed": {
            n: round(full[n]["cache_bytes"] / comp[n]["cache_bytes"], 2) for n in comp if n in full
        },
        "all_cache_bytes_match_formula": all(r.get("cache_bytes_match", False) for r in rows if "error" not in r),
    }
    print(json.dumps({
        "benchmark": "bench_model",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "config": "2 layers, d_model 128, 4 heads x 32, local window 16; compressed = S=4 W=8 overlap_split tied K=V",
        "prefill_chunk": args.chunk,
        "rows": rows,
        "summary": summary,
    }, indent=2))


if __name__ == "__main__":
    main()
