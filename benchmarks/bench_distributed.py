"""A specialization map on zoo ``w8s4``: one process with 2 threads against 2 processes (gloo) with 1 thread
(and one process with 1 thread, the work itself).

Each configuration runs in fresh processes (started as torchrun starts them: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``), loads the model, warms up, then times ``specialization_map`` between two
barriers; the two configurations run in turns and each keeps its best turn. The gather overhead is the time
rank 0 spends inside the per-round gathers (``gather_s``, which includes waiting for the slower rank), and
the cost of one gather of a round's payload with both ranks ready (``gather_round_ms``). Every run's
``correct_ko`` and ``logit_diff_ko`` are checked against the single process's, bit for bit.

    .venv/bin/python -m benchmarks.bench_distributed [--n-per-residue 4] [--turns 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import emit

ROOT = Path(__file__).resolve().parents[1]


def worker(engine: str, n_per_residue: int, threads: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import phaselens
    import phaselens.parallel.distributed as pd

    torch.set_num_threads(threads)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        dist.init_process_group("gloo")
    model = phaselens.load("zoo:w8s4")
    phaselens.evaluate(model, n_per_residue=1, progress=False, n_permutations=10, n_bootstrap=10)  # warm-up
    spent = {"gather_s": 0.0, "gathers": 0}
    gather = pd.gather

    def timed(obj, *, stage=""):
        t0 = time.perf_counter()
        try:
            return gather(obj, stage=stage)
        finally:
            spent["gather_s"] += time.perf_counter() - t0
            spent["gathers"] += 1

    pd.gather = timed
    if size > 1:
        dist.barrier()
    t0 = time.perf_counter()
    pm = phaselens.specialization_map(model, n_per_residue=n_per_residue, engine=engine, progress=False,
                                      n_bootstrap=200)
    if size > 1:
        dist.barrier()
    seconds = time.perf_counter() - t0
    pd.gather = gather
    out = {"seconds": seconds, **spent, "cells": len(pm.cells), "items": int(len(pm.residue)),
           "digest": hashlib.sha256(pm.correct_ko.tobytes() + pm.logit_diff_ko.tobytes()).hexdigest()}
    if size > 1:  # one round's payload with both ranks ready: per_call cells x (correct, logit_diff) of N items
        n = len(pm.residue)
        per_call = max(1, 4096 // n) if engine == "suffix" else 1
        payload = {"idx": list(range(per_call)), "out": [(np.zeros(n, bool), np.zeros(n, np.float32))] * per_call,
                   "error": None}
        dist.barrier()
        t1 = time.perf_counter()
        for _ in range(20):
            pd.gather(payload)
        out["gather_round_ms"] = (time.perf_counter() - t1) / 20 * 1e3
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(engine: str, n_per_residue: int, procs: int, threads: int) -> dict:
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(procs)}
    cmd = [sys.executable, "-m", "benchmarks.bench_distributed", "--worker", engine, "--n-per-residue", str(n_per_residue),
           "--threads", str(threads)]
    t0 = time.perf_counter()
    running = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                                text=True) for r in range(procs)]
    outs = [p.communicate()[0] for p in running]
    if any(p.returncode for p in running):
        raise SystemExit(f"a worker failed: {[p.returncode for p in running]}")
    result = json.loads(outs[0].strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None)
    ap.add_argument("--n-per-residue", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--engines", default="full,suffix")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.n_per_residue, args.threads)
        return
    load_before = os.getloadavg()
    rows = []
    for engine in args.engines.split(","):
        runs: dict[str, list[dict]] = {"1x2": [], "2x1": [], "1x1": []}
        for _ in range(args.turns):  # in turns, so a change of the machine's load hits every side alike
            runs["1x2"].append(launch(engine, args.n_per_residue, 1, 2))
            runs["2x1"].append(launch(engine, args.n_per_residue, 2, 1))
            runs["1x1"].append(launch(engine, args.n_per_residue, 1, 1))
        one, two, base = (min(runs[k], key=lambda r: r["seconds"]) for k in ("1x2", "2x1", "1x1"))
        same = len({r["digest"] for v in runs.values() for r in v}) == 1
        rows.append({"engine": engine, "cells": one["cells"], "items": one["items"],
                     "one_process_two_threads_s": one["seconds"], "two_processes_one_thread_s": two["seconds"],
                     "one_process_one_thread_s": base["seconds"], "speedup": one["seconds"] / two["seconds"],
                     "speedup_over_one_thread": base["seconds"] / two["seconds"], "gather_s": two["gather_s"],
                     "gathers": two["gathers"], "gather_share": two["gather_s"] / two["seconds"],
                     "gather_round_ms": two["gather_round_ms"], "identical_results": same,
                     "all_turns_s": {k: [round(r["seconds"], 3) for r in v] for k, v in runs.items()},
                     "process_wall_s": {k: min(r["process_wall_s"] for r in v) for k, v in runs.items()}})
    emit("distributed", {"model": "w8s4", "n_per_residue": args.n_per_residue, "cpus": os.cpu_count(),
                         "load_average_before": load_before, "load_average_after": os.getloadavg(), "rows": rows,
                         "goal": "speedup >= 1.6 for the map whose cells dominate (engine full)"})


if __name__ == "__main__":
    main()
