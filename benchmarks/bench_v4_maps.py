"""Per-head knockout maps on a faithful tiny DeepSeek-V4 through the adapter: the query-suffix engine.

The model is the test suite's tiny V4 (``tests/support/deepseek.py``: RoPE as DeepSeek's reference computes it)
resized to 8 layers x 16 heads, with the released models' layer pattern (two sliding-window layers, then CSA
stride 4 and HCA stride 128 alternating), sliding window 128 and ``index_topk="all"``, prefilled in chunks of
512. The items are KVRecall at 1K, 4K and 8K tokens, one per residue mod 8 (8 items); the map is every
single-head zero knockout (128 cells).

Reported per length:

* ``map_s``: the whole ``specialization_map`` (engine="auto", i.e. the query-suffix engine), of which
  ``engine_build_s`` is the clean prefix prefill and clean query step;
* ``forward_s``: one full forward of the 8 items (what the full engine pays per cell; its map would take
  about ``cells + 1`` of them: ``full_map_estimate_s``);
* ``marginal_per_cell_s``: (map - engine build) / cells, against a full forward (``forward_over_marginal``);
* ``physical_limit_s``: one full forward plus, per cell, one query-row pass through the layers at and above
  the cell's layer (each layer's pass timed alone on a built engine, best of 3); ``map_over_limit``;
* peak resident memory of the map and of one forward (Linux ``VmHWM``, reset between the two), and of the
  process after building the model (``rss_model_mib``).

At the shortest length it also checks two cells against full forwards with hand-written hooks, and measures
how often the query row's indexer picks differ from the uncached forward's with a binding ``index_topk``.
Each length runs in its own process (clean peak memory). Times are CPU seconds of that process
(``time.process_time``, one thread), which a shared machine's load does not inflate; the wall seconds are
reported beside them (``*_wall_s``).

    nice -n 15 .venv/bin/python -m benchmarks.bench_v4_maps [--lengths 1024 4096 8192] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import emit

ROOT = Path(__file__).resolve().parent.parent

LAYER_TYPES = ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3
N_LAYERS, N_HEADS, MODULUS = 8, 16, 8


def build_model():
    from tests.support.deepseek import tiny_v4_model

    return tiny_v4_model(0, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, layer_types=LAYER_TYPES,
                         compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                         sliding_window=128)


def items(adapter, tokens: int):
    """KVRecall items of at least ``tokens`` tokens, one per residue mod 8."""
    from phaselens.tasks import KVRecall

    def task(filler: int) -> KVRecall:
        return KVRecall(n_records=48, block_filler=filler, n_demos=2, min_distance=8, modulus=MODULUS)

    lo, hi = 1, 8 * tokens
    while lo < hi:  # the smallest filler that reaches the length
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if task(mid).seq_len(adapter.analysis_spec) < tokens else (lo, mid)
    return task(lo).build(adapter.analysis_spec, n_per_residue=1, seed=0)


def rss(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (peak) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn) -> tuple[float, float, object]:
    """``(cpu_s, wall_s, result)`` of one call."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def best(fn, repeats: int) -> float:
    """Least CPU seconds of ``repeats`` calls."""
    return min(timed(fn)[0] for _ in range(repeats))


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def one_length(tokens: int, chunk: int, checks: bool) -> dict:
    import phaselens
    from phaselens.contract.cells import Cell

    warnings.simplefilter("ignore")
    hf = build_model()
    adapter = phaselens.from_hf(hf, index_topk="all", chunk=chunk)
    batch = items(adapter, tokens)
    rss_model = rss("VmRSS")
    built: dict = {}
    make = adapter._query_engine

    def timed_engine(*args, **kwargs):  # time the prefill inside the map, and keep the engine
        built["s"], built["wall_s"], built["engine"] = timed(lambda: make(*args, **kwargs))
        return built["engine"]

    adapter._query_engine = timed_engine  # the capability returns this attribute
    reset_peak()
    map_s, map_wall, pm = timed(lambda: phaselens.specialization_map(adapter, batch, method="zero", kinds=("head",),
                                                                      n_bootstrap=0, progress=False))
    peak_map = rss("VmHWM")
    cells = len(pm.cells)
    assert pm.metadata["engine"] == "suffix"

    reset_peak()
    with torch.no_grad():
        forward_s, forward_wall, _ = timed(lambda: adapter(batch.tokens, logits="query", query_len=1))
    peak_forward = rss("VmHWM")

    eng = built["engine"]
    per_layer = [best(lambda layer=layer: eng.run([Cell(layer, [0])]), 3) for layer in range(N_LAYERS)]
    limit = forward_s + sum(per_layer[int(row.layer)] for row in pm.cells.itertuples())
    marginal = (map_s - built["s"]) / cells
    out = {
        "tokens": int(batch.tokens.shape[1]), "items": len(batch), "query_slots": len(eng.groups), "cells": cells,
        "chunk": chunk, "map_s": map_s, "engine_build_s": built["s"], "forward_s": forward_s,
        "map_wall_s": map_wall, "engine_build_wall_s": built["wall_s"], "forward_wall_s": forward_wall,
        "full_map_estimate_s": (cells + 1) * forward_s, "map_over_forward": map_s / forward_s,
        "speedup_vs_full_engine": (cells + 1) * forward_s / map_s, "marginal_per_cell_s": marginal,
        "forward_over_marginal": forward_s / marginal, "query_pass_s_per_layer": per_layer,
        "physical_limit_s": limit, "map_over_limit": map_s / limit, "rss_model_mib": rss_model,
        "peak_map_mib": peak_map, "peak_forward_mib": peak_forward,
    }
    if checks:
        out["check"] = check_cells(adapter, batch, pm)
        out["index_topk_picks"] = topk_picks(hf, batch, chunk)
    return out


def check_cells(adapter, batch, pm) -> dict:
    """Two cells of the map against full forwards with a hand-written hook at the query slot."""
    from phaselens.analyses.scoring import answer_metrics

    rows = torch.arange(len(batch))
    worst = 0.0
    for i in (0, len(pm.cells) - 1):
        cell = pm.cells.iloc[i]

        def fn(z, hook, head=int(cell.heads[0])):
            z = z.clone()
            z[rows, hook.rows(batch.query_pos, z.shape[1]), head] = 0.0
            return z

        with torch.no_grad():
            logits = adapter.run_with_hooks(batch.tokens, fwd_hooks=[(f"blocks.{int(cell.layer)}.attn.hook_z", fn)],
                                            logits="query", query_len=1)[:, -1]
        ref = answer_metrics(logits, batch.answer, batch.wrong)["logit_diff"]
        worst = max(worst, float(abs(ref - pm.logit_diff_ko[i]).max()))
    return {"cells_checked": 2, "max_abs_diff_logit_diff": worst}


def topk_picks(hf, batch, chunk: int) -> dict:
    """With a binding index_topk (a quarter of the entries at this length), the query row's indexer picks in
    the engine (cached prefix) against the uncached forward and the adapter's chunked forward with the same
    pieces: the fraction of picks that differ, over items and CSA layers."""
    import phaselens

    entries = int(batch.tokens.shape[1]) // 4
    k = max(1, entries // 4)
    csa = [i for i, t in enumerate(LAYER_TYPES) if t == "compressed_sparse_attention"]
    indexers = {i: hf.model.layers[i].self_attn.compressor.indexer for i in csa}
    picks: dict = {}

    def recording(tag, fn):
        def hook(i):
            def h(module, args, out):
                picks[(tag, i)] = out[:, -1].sort(-1).values
            return h

        handles = [m.register_forward_hook(hook(i)) for i, m in indexers.items()]
        try:
            with torch.no_grad():
                fn()
        finally:
            for h in handles:
                h.remove()

    cached = phaselens.from_hf(hf, index_topk=k, chunk=chunk)
    recording("engine", lambda: cached.query_engine(batch.tokens, batch.query_pos))
    recording("chunked", lambda: cached(batch.tokens, logits="query", query_len=1))
    recording("uncached", lambda: phaselens.from_hf(hf, index_topk=k)(batch.tokens, logits="query", query_len=1))

    def differ(a: str, b: str) -> float:
        n = same = 0
        for i in csa:
            x, y = picks[(a, i)], picks[(b, i)]
            for r in range(x.shape[0]):
                same += len(set(x[r].tolist()) & set(y[r].tolist()))
                n += x.shape[1]
        return 1 - same / n

    phaselens.from_hf(hf, index_topk="all")  # leave the shared model as the map measured it
    return {"index_topk": k, "entries": entries, "csa_layers": csa, "picks_compared": len(csa) * len(batch) * k,
            "differ_vs_uncached": differ("engine", "uncached"), "differ_vs_chunked_same_pieces":
            differ("engine", "chunked")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", help="also write the JSON here after each length (a partial run keeps what it measured)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one length in this process
    ap.add_argument("--checks", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(one_length(args.one, args.chunk, args.checks)))
        return
    t0 = time.time()
    runs: list[dict] = []

    def payload() -> dict:
        return {
            "config": f"tiny V4 (tests/support/deepseek.py) at {N_LAYERS} layers x {N_HEADS} heads, hidden 64, head_dim 64, "
                      "layers SSCHCHCH (CSA 4, HCA 128), window 128, index_topk all; zero knockouts of every head",
            "times": "CPU seconds of the measuring process (one thread); wall seconds in *_wall_s",
            "runs": runs, "wall_s": time.time() - t0, "lengths_asked": args.lengths,
            "goal_marginal_50x_at_4k": next((r["forward_over_marginal"] >= 50 for r in runs if r["tokens"] >= 4096),
                                            None),
            "goal_map_within_2x_of_limit": all(r["map_over_limit"] <= 2 for r in runs),
        }

    for j, length in enumerate(args.lengths):
        cmd = [sys.executable, "-m", "benchmarks.bench_v4_maps", "--one", str(length), "--chunk", str(args.chunk)] + (["--checks"] if j == 0 else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{length}: {runs[-1]['map_s']:.1f} s map, {runs[-1]['forward_s']:.1f} s forward (CPU)", file=sys.stderr,
              flush=True)
        if args.out:
            tmp = Path(args.out + ".tmp")
            head = {"benchmark": "bench_v4_maps", "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "machine": platform.machine()}  # as common.emit prints it
            tmp.write_text(json.dumps({**head, **payload()}, indent=2, default=float))
            tmp.replace(args.out)
    emit("bench_v4_maps", payload())


if __name__ == "__main__":
    main()
