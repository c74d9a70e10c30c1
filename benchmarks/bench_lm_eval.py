"""What phase stratification costs in lm-evaluation-harness, beside lm-eval's own run of the unstratified task.

A small Llama (random weights, built here; nothing downloaded) with a byte-level BPE answers a lookup task in
lm-eval's standard format over local JSONL (multiple choice, and generation), written here. Each side is one
``simple_evaluate`` call, task building included (``load_task`` for the plain task, ``stratify`` for the
stratified one): lm-eval's own ``hf`` model on the plain task against the same model on the stratified task
(every document ``S`` times, behind ``k = 0..S-1`` filler tokens, each context checked token-exact), and the
same with the ``phaselens`` model. The sides run in turns; each is the best of ``--repeats``. Goal: the
stratified run costs about ``S`` times the plain one, and no more than 1.1 x ``S``. A run of one document
(``limit=1``) measures what a run costs whatever its size (lm-eval's set-up, the model's info, the metrics), so
``per_document_ratio`` compares what the documents themselves cost.

    .venv/bin/python -m benchmarks.bench_lm_eval [--docs 32] [--records 24] [--stride 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import emit


def write_tasks(folder: Path, docs: int, records: int, seed: int = 0) -> dict[str, Path]:
    """A lookup among ``records`` records per document, as a multiple-choice and a generation task."""
    from phaselens.tasks.records import DEFAULT_KEYS, DEFAULT_VALUES

    rng = random.Random(seed)
    mc, gen = [], []
    for _ in range(docs):
        keys, values = rng.sample(DEFAULT_KEYS, records), [rng.choice(DEFAULT_VALUES) for _ in range(records)]
        t = rng.randrange(records)
        ctx = "Records:" + "".join(f" {k}: {v}." for k, v in zip(keys, values)) + f"\nLookup: {keys[t]}:"
        others = [v for v in DEFAULT_VALUES if v != values[t]]
        mc.append({"context": ctx, "choices": [f" {values[t]}", *(f" {v}" for v in rng.sample(others, 3))], "label": 0})
        gen.append({"context": ctx, "answer": f" {values[t]}"})
    paths = {}
    for name, rows, body in (
        ("bench_mc", mc, "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: label\n"
                         "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"),
        ("bench_gen", gen, "output_type: generate_until\ndoc_to_target: answer\ngeneration_kwargs:\n  until: ['.']\n"
                           "  max_gen_toks: 4\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                               f"test_split: test\ndoc_to_text: context\n{body}")
    return paths


def small_llama(vocab: int, hidden: int, layers: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=vocab - 1, pad_token_id=0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--records", type=int, default=24)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: two OpenMP threads on a busy 2-core machine stall each other 20x)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tmp) / "datasets"))  # before datasets is imported
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        from phaselens.integrations.lm_eval import PhaseLensLM, stratify
        from phaselens.integrations.lm_eval.stratification import load_task
        from tests.support.lm_eval import bpe_tokenizer

        paths = write_tasks(Path(tmp), args.docs, args.records)
        tok = bpe_tokenizer()
        model = small_llama(len(tok), args.hidden, args.layers)
        manager = TaskManager(include_defaults=False)
        models = {"hf": HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch_size),
                  "phaselens": PhaseLensLM(model=model, tokenizer=tok, stride=args.stride, batch_size=args.batch_size)}
        tokens = [len(tok(json.loads(line)["context"])["input_ids"])
                  for line in (Path(tmp) / "bench_mc.jsonl").read_text().splitlines()]

        def run(lm: object, path: Path, side: str) -> None:
            task = stratify(str(path), tokenizer=tok, stride=args.stride) if side == "stratified" else \
                load_task(str(path))
            simple_evaluate(model=lm, tasks=[task], task_manager=manager, verbosity="ERROR",
                            limit=1 if side == "one_doc" else None)

        rows = []
        for task, path in paths.items():
            for name, lm in models.items():
                times: dict[str, list[float]] = {"plain": [], "stratified": [], "one_doc": []}
                run(lm, path, "plain")  # warm-up: imports, the dataset's first read
                for _ in range(args.repeats):
                    for side in times:
                        t0 = time.perf_counter()
                        run(lm, path, side)
                        times[side].append(time.perf_counter() - t0)
                plain, strat, fixed = (min(times[k]) for k in ("plain", "stratified", "one_doc"))
                rows.append({"task": task, "model": name, "plain_s": plain, "stratified_s": strat,
                             "ratio": strat / plain, "ratio_over_S": strat / plain / args.stride,
                             "one_document_s": fixed, "per_document_ratio": (strat - fixed) / (plain - fixed),
                             "turns": times})
        emit("bench_lm_eval", {
            "model": f"random Llama, {args.layers} layers x {args.hidden}, vocab {len(tok)}, float32, CPU",
            "docs": args.docs, "prompt_tokens_mean": sum(tokens) / len(tokens), "stride": args.stride,
            "batch_size": args.batch_size, "lm_eval": __import__("lm_eval").__version__,
            "load_average": list(os.getloadavg()), "cpus": os.cpu_count(), "rows": rows,
            "goal": "ratio about S and ratio_over_S <= 1.1 (per_document_ratio: the documents' own cost)",
        })


if __name__ == "__main__":
    main()
