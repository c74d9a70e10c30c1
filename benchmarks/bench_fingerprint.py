"""Fingerprint cost: ``model_fingerprint`` over a synthetic model of ``--mb`` MB of float32 parameters, every
byte hashed (the default up to 1 GiB) and as a strided sample (the path above 1 GiB), side by side with a
bare ``hashlib.sha256`` over the same bytes. Prints one JSON document.

    .venv/bin/python -m benchmarks.bench_fingerprint [--mb 1024] [--tensors 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time

import torch

from phaselens.storage.fingerprints import model_fingerprint


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    per = args.mb * 2**20 // 4 // args.tensors
    module = torch.nn.Module()
    for i in range(args.tensors):
        module.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(per)))
    raw = [p.detach().numpy().view("uint8") for p in module.parameters()]

    def bare() -> None:
        h = hashlib.sha256()
        for r in raw:
            h.update(r)

    full = best(lambda: model_fingerprint(module), args.repeat)
    sampled = best(lambda: model_fingerprint(module, full_limit=0), args.repeat)
    sha = best(bare, args.repeat)
    print(json.dumps({
        "mb": args.mb, "tensors": args.tensors, "machine": platform.machine(), "threads": torch.get_num_threads(),
        "full_s": round(full, 3), "full_gb_per_s": round(args.mb / 1024 / full, 2),
        "bare_sha256_s": round(sha, 3), "full_vs_bare_sha256": round(full / sha, 3),
        "sampled_s": round(sampled, 4), "full_vs_sampled": round(full / sampled, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
