"""Why bf16 one-token decoding differs from the parallel forward on the tiny V4.1 checkpoint.

    .venv/bin/python scripts/v41_decode_attribution.py

Runs 2 x 40 random tokens through the tiny checkpoint of ``tests/support/deepseek_v41.py`` in bf16, once in parallel
and once a token at a time through the cache, per ``quantize`` and ``index_topk``, and prints JSON with the
max |logit difference| in three modes:

* ``torch``: as shipped.
* ``fp32_gemm_fp64``: every ``F.linear`` whose weight is fp32 (the hyper-connection mixes, the ratio-2
  compressor, the router, the head) accumulates in fp64 and rounds to fp32, which makes each output row
  independent of how many rows the call has. Nothing else changes.
* ``all_gemm_fp64``: the same for every ``F.linear``.

A diagnostic (it patches ``torch.nn.functional.linear`` in this process only); docs/deepseek_v41.md quotes it.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

from phaselens.models.deepseek_v41 import IndexTopKWarning, load_v41  # noqa: E402
from tests.support.deepseek_v41 import write_tiny_checkpoint  # noqa: E402

_linear = F.linear
_mode = "torch"


def _patched_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if _mode == "torch" or (_mode == "fp32_gemm_fp64" and w.dtype != torch.float32):
        return _linear(x, w, b)
    out = _linear(x.double(), w.double(), None if b is None else b.double())
    return out.to(torch.promote_types(x.dtype, w.dtype))


def main() -> None:
    global _mode
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", IndexTopKWarning)
    F.linear = _patched_linear
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny")
        toks = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
        for topk in (None, "all"):
            for quantize in (None, "kv", "fp8"):
                model = load_v41(ckpt, dtype=torch.bfloat16, quantize=quantize, index_topk=topk)
                row = {"index_topk": topk or model.config.index_topk, "quantize": quantize}
                for mode in ("torch", "fp32_gemm_fp64", "all_gemm_fp64"):
                    _mode = mode
                    full = model(toks)
                    cache = model.new_cache(2)
                    steps = torch.cat([model(toks[:, i : i + 1], cache=cache) for i in range(40)], 1)
                    row[mode] = float((steps - full).abs().max())
                rows.append(row)
    F.linear = _linear
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
