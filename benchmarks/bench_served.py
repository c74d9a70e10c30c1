"""Served evaluation against a plain concurrent client sending the same requests to the same server.

A real ``transformers serve`` runs a tiny DeepSeek-V4 on 127.0.0.1 (built and saved here; nothing downloaded).
``evaluate`` on the served model (its requests, every reply's token-count check, the greedy answers read back
through the tokenizer, the journaling runner, the statistics) is timed against a bare ``httpx`` client on a
thread pool of the same size that posts the identical request bodies and keeps the replies. The two sides run
in turns; each is the best of ``--repeats`` turns.

    .venv/bin/python -m benchmarks.bench_served [--n-per-residue 8] [--records 48] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import phaselens
from benchmarks.common import emit
from phaselens.tasks import Needle
from tests.support.serving import Server, write_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-per-residue", type=int, default=8)
    ap.add_argument("--records", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny-v4")
        with Server(ckpt) as server:
            model = phaselens.load(server.url, tokenizer=str(ckpt), concurrency=args.concurrency, progress=False)
            task = Needle(model.tokenizer, n_records=args.records, n_demos=1, paired=True, modulus=8,
                          padding="shared_prefix")
            batch = task.build(model.dims.analysis_spec, n_per_residue=args.n_per_residue)
            ends = (batch.query_pos + 1).tolist()
            bodies = [model.dialect.request(model.served_name, ids, model.prompt_text(ids), int(a), int(w))[2]
                      for ids, a, w in ((batch.tokens[i, : ends[i]].tolist(), batch.answer[i], batch.wrong[i])
                                        for i in range(len(batch)))]
            client = httpx.Client(timeout=600.0)  # the baseline's own plain client (phaselens' is asynchronous)
            url = model.endpoint.api + "/completions"

            def plain() -> list:
                with ThreadPoolExecutor(args.concurrency) as pool:
                    return list(pool.map(lambda b: client.post(url, json=b).json(), bodies))

            def ours() -> object:
                return phaselens.evaluate(model, batch, progress=False, n_permutations=200, n_bootstrap=0)

            plain()  # warm-up: the server's first requests
            times: dict[str, list[float]] = {"plain": [], "ours": []}
            for _ in range(args.repeats):
                for name, fn in (("ours", ours), ("plain", plain)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            best = {k: min(v) for k, v in times.items()}
            prompts = [batch.tokens[i, : ends[i]].tolist() for i in range(len(batch))]
            t0 = time.perf_counter()
            for ids in prompts:  # what phaselens adds per request on a text server: the checked text round trip
                model.prompt_text(ids)
            checks = time.perf_counter() - t0
            emit("bench_served", {
                "server": "transformers serve (CPU, tiny DeepSeek-V4, float32)", "protocol": model.dialect.name,
                "requests": len(bodies), "prompt_tokens_per_request": sum(ends) / len(ends),
                "concurrency": args.concurrency, "plain_client_s": best["plain"], "served_evaluate_s": best["ours"],
                "evaluate_over_plain": best["ours"] / best["plain"], "text_round_trips_s": checks, "turns": times,
            })
            model.close()
            client.close()


if __name__ == "__main__":
    main()
