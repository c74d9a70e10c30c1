"""Compare phaselens' DeepSeek-V4.1 logits with DeepSeek's reference inference code on a real checkpoint.

NOT RUN BY PHASELENS' TESTS, AND NOT RUN AT ALL WHERE PHASELENS IS DEVELOPED: it needs the released weights
(a local DeepSeek-V4.1 checkpoint directory, which ships the reference ``inference/model.py``, ``kernel.py``
and ``engram.py``), a CUDA GPU, and the reference's requirements (TileLang). phaselens does not vendor or
import DeepSeek's code anywhere else; this script imports it from the checkpoint directory at run time.

What it does, for the first ``--n-layers`` backbone layers (the whole model does not fit one GPU once
phaselens dequantizes it to bf16: about 27 GB of routed experts per layer):

1. builds the reference ``Transformer`` from ``inference/config.json`` truncated the same way, with Engram,
   the draft layers and vision off, and fills it straight from the HF shards as ``convert.py`` does for one
   rank (names unchanged, FP8 weights and scales as stored, FP4 experts viewed as ``float4_e2m1fn_x2``,
   ``wo_a`` dequantized to bf16);
2. loads phaselens' model with ``dtype=bf16, quantize="fp8", engram="drop", n_layers=N`` (the reference's
   numerics, without Engram as in 1);
3. prefills ``--prompt-len`` random tokens in both (the reference returns the last position's logits), then
   decodes ``--decode`` more tokens one at a time, and prints JSON with the max absolute and relative logit
   differences and top-1 agreement per step.

Usage (one GPU):

    python scripts/v41_parity.py --ckpt /data/DeepSeek-V4.1-Flash --n-layers 3 --prompt-len 300 --decode 8

Use ``--prompt-len`` above the sliding window (128) and enough layers to include a KV source (layer 2).
bf16 GEMMs differ in accumulation order between the reference's FP8 kernels and torch, so expect agreement
to bf16 rounding (relative differences of order 1e-2 on logits), not bit equality.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phaselens.models.deepseek_v41 import load_v41  # noqa: E402
from phaselens.models.deepseek_v41.quant import dequant_fp8_blocks  # noqa: E402
from phaselens.models.deepseek_v41.weights import normalize, shard_map  # noqa: E402


def reference_model(ckpt: Path, n_layers: int, max_seq_len: int):
    """The reference ``Transformer`` for the first ``n_layers`` layers, weights from the HF shards."""
    sys.path.insert(0, str(ckpt / "inference"))
    ref = importlib.import_module("model")
    raw = json.loads((ckpt / "inference" / "config.json").read_text())
    names = {f.name for f in fields(ref.ModelArgs)}
    args = ref.ModelArgs(**{k: v for k, v in raw.items() if k in names})
    keep = lambda ids: tuple(i for i in ids if i < n_layers)  # noqa: E731
    args.n_layers, args.max_seq_len, args.max_batch_size = n_layers, max_seq_len, 1
    args.compress_ratios = tuple(args.compress_ratios[:n_layers])
    args.kv_source_layers, args.index_source_layers = keep(args.kv_source_layers), keep(args.index_source_layers)
    if args.candidate_source_layer >= n_layers:
        args.candidate_source_layer = -1
    args.engram_layer_ids, args.engram_num_embeddings = (), ()
    args.dspark_block_size, args.vision_n_layers, args.temperature = 0, 0, 0.0
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = ref.Transformer(args)
    files = shard_map(ckpt)
    by_name = {normalize(k): k for k in files}
    block = tuple(json.loads((ckpt / "config.json").read_text()).get("quantization_config", {}).get("weight_block_size", (32, 32)))
    from safetensors import safe_open

    state = {}
    for key, param in model.state_dict().items():
        src = by_name.get(key)
        if src is None:
            raise KeyError(f"the checkpoint has no tensor for the reference's {key}")
        with safe_open(str(files[src]), framework="pt", device="cuda") as f:
            t = f.get_tensor(src)
        if key.endswith("wo_a.weight") and t.dtype == torch.float8_e4m3fn:  # convert.py: wo_a to bf16
            with safe_open(str(files[by_name[key[:-6] + "scale"]]), framework="pt", device="cuda") as f:
                t = dequant_fp8_blocks(t, f.get_tensor(by_name[key[:-6] + "scale"]), block)
        if param.dtype == torch.float4_e2m1fn_x2:
            t = t.view(torch.float4_e2m1fn_x2)
        state[key] = t.to(param.dtype) if t.dtype != param.dtype else t
    model.load_state_dict(state, strict=True)
    return model.eval()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.float(), b.float()
    return {"max_abs": float((a - b).abs().max()), "rel_fro": float((a - b).norm() / b.norm()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--n-layers", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    total = a.prompt_len + a.decode
    ref = reference_model(a.ckpt, a.n_layers, total)
    ours = load_v41(a.ckpt, device="cuda", dtype=torch.bfloat16, quantize="fp8", engram="drop", n_layers=a.n_layers)
    g = torch.Generator().manual_seed(a.seed)
    tokens = torch.randint(0, ours.cfg.d_vocab, (1, total), generator=g).cuda()
    with torch.inference_mode():
        mine = ours(tokens)  # [1, total, vocab], fp32
        rows = []
        _, logits, _ = ref(tokens[:, : a.prompt_len], 0)
        rows.append({"position": a.prompt_len - 1, **compare(mine[:, a.prompt_len - 1], logits)})
        for i in range(a.prompt_len, total):
            _, logits, _ = ref(tokens[:, i : i + 1], i)
            rows.append({"position": i, **compare(mine[:, i], logits)})
    print(json.dumps({"checkpoint": str(a.ckpt), "n_layers": a.n_layers, "prompt_len": a.prompt_len,
                      "phaselens": ours.analysis_metadata, "steps": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
