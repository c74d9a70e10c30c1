"""Cached decoding against the parallel forward on the tiny V4.1 test checkpoint, per dtype and ``quantize``.

    .venv/bin/python scripts/v41_tiny_check.py

Writes the tiny checkpoint of ``tests/support/deepseek_v41.py`` to a temporary directory, runs 2 x 40 random tokens in
one forward, in chunks (13, 1, 1, 25) and one token at a time, and prints JSON: the max |logit difference|
of each cached run from the parallel forward (docs/deepseek_v41.md quotes it).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

from phaselens.models.deepseek_v41 import IndexTopKWarning, load_v41  # noqa: E402
from tests.support.deepseek_v41 import write_tiny_checkpoint  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", IndexTopKWarning)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny")
        toks = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            for quantize in (None, "kv", "fp8"):
                model = load_v41(ckpt, dtype=dtype, quantize=quantize)
                full = model(toks)
                out = {}
                for label, splits in (("chunks", [0, 13, 14, 15, 40]), ("tokens", list(range(41)))):
                    cache = model.new_cache(2)
                    parts = [model(toks[:, i:j], cache=cache) for i, j in zip(splits[:-1], splits[1:])]
                    out[label] = float((torch.cat(parts, 1) - full).abs().max())
                rows.append({"dtype": str(dtype).replace("torch.", ""), "quantize": quantize,
                             "max_abs_logit": float(full.abs().max()), **out})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
