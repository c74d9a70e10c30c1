"""GPU checks of issue 24 (reliability, round 3) that CPU tests cannot make; prints one JSON object.

Run on a CUDA machine from the repository root (about a minute; nothing is downloaded):

    python -m tests.gpu.reliability > gpu_reliability.json

What it checks, each a key of the JSON (``ok`` true/false, and what it saw):

* ``v41_packed_load``: a tiny DeepSeek-V4.1 checkpoint in the released formats (FP8 blocks, packed FP4
  experts) loads on ``cuda`` through the boundary check (tensor names and layer roles before any weight is
  read) and gives finite logits; with ``head.weight`` removed it is refused by name.
* ``v4_load_cuda``: a tiny transformers DeepSeek-V4 (bf16) loads on ``cuda`` and with ``device_map="auto"``
  through transformers' loading info (nothing missing or unexpected); without ``lm_head`` it is refused by
  name. Skipped when the installed transformers has no ``deepseek_v4`` (it needs >= 5.24).
* ``pricing_cuda``: ``runtime.budget`` reads the GPU's free memory; a forward that cannot fit on the GPU is
  refused with a ``ResourceError`` naming a ``batch_size`` that fits, and that ``batch_size`` runs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

import phaselens

DEVICE = os.environ.get("PHASELENS_CHECK_DEVICE", "cuda")  # "cpu": a dry run of the script itself


def _drop(root: Path, name: str) -> None:
    """Remove tensor ``name`` from a (possibly sharded) safetensors checkpoint directory."""
    from safetensors.torch import load_file, save_file

    index = root / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        shard = root / data["weight_map"].pop(name)
        index.write_text(json.dumps(data))
    else:
        shard = root / "model.safetensors"
    tensors = load_file(str(shard))
    tensors.pop(name)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def v41_packed_load(tmp: Path) -> dict:
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp / "v41")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = phaselens.load(f"hf:{root}", device=DEVICE)
        logits = model(torch.randint(0, 128, (1, 24), device=DEVICE))
    finite = bool(torch.isfinite(logits).all())
    _drop(root, "head.weight")
    try:
        phaselens.load(f"hf:{root}", device=DEVICE)
        refused = "loaded"
    except phaselens.errors.CheckpointError as err:
        refused = str(err)
    return {"ok": finite and "head.weight" in refused, "finite_logits": finite, "without_head": refused[:200]}


def v4_load_cuda(tmp: Path) -> dict:
    try:
        from tests.support.deepseek import tiny_v4_model
    except ImportError as err:
        return {"ok": True, "skipped": f"no deepseek_v4 in this transformers ({err})"}
    import transformers

    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        return {"ok": True, "skipped": f"transformers {transformers.__version__} has no deepseek_v4 (needs >= 5.24)"}
    root = tmp / "v4"
    tiny_v4_model().to(torch.bfloat16).save_pretrained(root)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for how, kw in (("device", {"device": DEVICE}), ("device_map", {"device_map": "auto"})):
            model = phaselens.load(f"hf:{root}", dtype=torch.bfloat16, **kw)
            first = next(model.model.parameters()).device
            out[how] = bool(torch.isfinite(model(torch.randint(0, 1000, (1, 24)).to(first))).all())
    _drop(root, "head.weight")
    try:
        phaselens.load(f"hf:{root}", device=DEVICE)
        out["without_lm_head"] = "loaded"
    except phaselens.errors.CheckpointError as err:
        out["without_lm_head"] = str(err)[:200]
    out["ok"] = out["device"] and out["device_map"] and "lm_head.weight" in out["without_lm_head"]
    return out


def pricing_cuda(tmp: Path) -> dict:
    import re

    from phaselens.runtime.budget import device_available, forward_bytes

    model = phaselens.load("zoo:w8s4", device="cuda")
    free = device_available("cuda")
    T = model.default_task.seq_len(model.dims.analysis_spec)
    one = sum(v for k, v in forward_bytes(model, T, 1, 1).items() if k != "weights")
    huge = int(2 * free // max(one, 1)) + 1  # a batch twice the GPU's free memory
    n = max(1, huge // model.default_task.modulus + 1)
    out = {"free_gib": round(free / 2**30, 2), "batch_refused": huge}
    try:
        phaselens.evaluate(model, n_per_residue=n, batch_size=huge, progress=False, n_bootstrap=0, n_permutations=1)
        out["refused"] = "ran"
    except phaselens.errors.ResourceError as err:
        out["refused"] = str(err)[:240]
    fits = re.search(r"use batch_size=([\d,]+) or fewer", out["refused"])
    out["ok"] = fits is not None
    if fits:
        b = min(int(fits[1].replace(",", "")), 512)
        ev = phaselens.evaluate(model, n_per_residue=4, batch_size=b, progress=False, n_bootstrap=0, n_permutations=1)
        out["ran_with_batch_size"] = b
        out["ok"] = bool(0.0 <= ev.mean <= 1.0)
    return out


def main() -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        sys.exit(1)
    report: dict = {"torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE}
    checks = (v41_packed_load, v4_load_cuda, pricing_cuda) if DEVICE == "cuda" else (v41_packed_load, v4_load_cuda)
    with tempfile.TemporaryDirectory() as tmp:
        for check in checks:
            try:
                report[check.__name__] = check(Path(tmp))
            except Exception as err:  # noqa: BLE001 - every check reports, none stops the others
                report[check.__name__] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                          "trace": traceback.format_exc()[-800:]}
    report["ok"] = all(v.get("ok") for v in report.values() if isinstance(v, dict))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
