"""Trace an FP8 rounding flip between phaselens' DeepSeek-V4.1 and DeepSeek's official code (tiny checkpoint, CPU).

Runs both models (``scripts/v41_parity.py``'s harness, same tiny checkpoint and tokens) with ``--quantize`` and
``--engram`` in fp32, then prints per layer the largest difference of the residual streams after the block and,
at ``--layer``, of the MoE input, its output, and how many of the MoE input's values land on another E4M3 code
when both are round-tripped through FP8 (groups of 32, as the reference's ``act_quant``). A handful of flipped
codes out of thousands, with inputs equal to 1e-6, is what "a rounding flip" means in docs/deepseek_v41.md.

    OMP_NUM_THREADS=1 python scripts/v41_flip_trace.py --reference DIR/inference --quantize fp8 --layer 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import v41_parity as vp  # noqa: E402

from phaselens.models.deepseek_v41 import load_v41  # noqa: E402
from phaselens.models.deepseek_v41.quant import fp8_round_trip  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", type=Path, required=True)
    p.add_argument("--quantize", choices=["none", "kv", "fp8"], default="fp8")
    p.add_argument("--engram", choices=["run", "drop"], default="run")
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--embed-std", type=float, default=1.0)
    a = p.parse_args()
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    q = None if a.quantize == "none" else a.quantize
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "t", engram=True, embed_std=a.embed_std, **vp.TINY)
        text = json.loads((ckpt / "config.json").read_text())["text_config"]
        ref = vp.import_reference(a.reference, "emulated")
        vp.emulated.configure(round_trips="off" if q is None else "e4m3")
        vp.publish_index_keys(ref, True)
        T = 24
        args = vp.reference_args(ref, text, n_layers=text["num_hidden_layers"], max_seq_len=T, batch=2,
                                 quantized=q == "fp8", engram=a.engram == "run")
        tokens = torch.randint(0, text["vocab_size"], (2, T), generator=torch.Generator().manual_seed(0))
        theirs: dict[str, torch.Tensor] = {}
        model = vp.build_reference(ref, ckpt, args, dtype=torch.float32, device="cpu")
        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(lambda m, inp, out, i=i: theirs.__setitem__(f"resid{i}", out[0].float()))
        model.layers[a.layer].ffn.register_forward_hook(
            lambda m, inp, out: theirs.update(ffn_in=inp[0].float(), ffn_out=out.float()))
        with torch.inference_mode():
            vp.run_reference(model, tokens, T)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours_model = load_v41(ckpt, dtype=torch.float32, quantize=q, engram=a.engram)
        ours: dict[str, torch.Tensor] = {}
        ours_model.blocks[a.layer].ffn.register_forward_hook(lambda m, inp, out: ours.update(ffn_in=inp[0], ffn_out=out))
        names = [f"blocks.{i}.hook_resid_post" for i in range(len(model.layers))]
        with torch.no_grad():
            _, cache = ours_model.run_with_cache(tokens, names_filter=names)
    rows = {f"layer {i} streams": float((cache[n] - theirs[f"resid{i}"]).abs().max()) for i, n in enumerate(names)}
    a_in, b_in = (t.reshape(-1, t.shape[-1]) for t in (ours["ffn_in"], theirs["ffn_in"]))
    flipped = int((fp8_round_trip(a_in, 32) != fp8_round_trip(b_in, 32)).sum())
    print(json.dumps({"quantize": q, "engram": a.engram, "embed_std": a.embed_std, "max_abs_difference": rows,
                      f"layer {a.layer} MoE input": float((a_in - b_in).abs().max()),
                      f"layer {a.layer} MoE output": float((ours["ffn_out"] - theirs["ffn_out"]).abs().max()),
                      f"layer {a.layer} MoE input values on another E4M3 code": f"{flipped} of {a_in.numel()}"},
                     indent=1))


if __name__ == "__main__":
    main()
