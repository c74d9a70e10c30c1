"""GPU check of packed FP8 / FP4 weights (issue 28): DeepSeek-V4.1 packed on CUDA, device maps, and the V4
adapter on transformers' packed modules. Prints one JSON object (also written to $OUT/gpu_packed_check.json).

    python -m tests.gpu.packed            # from the repository root, on a machine with a CUDA GPU
    python -m tests.gpu.packed --device cpu   # a smoke test of the script itself (no GPU facts)

Tiny random models only (no weights downloaded); about a minute on one H200. Parts:

* ``v41``: a tiny V4.1 checkpoint in the release's formats, experts dominating (``tests/support/deepseek_v41.py``):
  packed vs dequantized logits on CUDA (fp32, bf16) and against the CPU; ``quantize="fp8"`` with
  transformers' finegrained-fp8 kernels (``kernels="auto"``) against phaselens's dequantize-then-multiply
  (``kernels="torch"``), and which path ran; GPU memory of a packed and a dequantized load; prefill and
  decoding tokens/s of each; ``device_map`` ``"auto"``, a map that offloads the last layers to the CPU, and a
  two-GPU map when two GPUs are visible; chunked prefill.
* ``v4``: needs transformers >= 5.24 (``DeepseekV4ForCausalLM``). A tiny V4 whose projections and experts are
  transformers' own ``FP8Linear`` / ``FP8GroupedLinear`` / ``FP8Experts`` (``tests/support/deepseek_packed.py``), on
  CUDA with transformers' kernels, against its dense twin on the CPU: logits, hooked ``hook_z``, under
  ``numerics`` reference / transformers and ``quantize`` None / fp8. transformers fetches the kernels through
  the ``kernels`` package (Hub); without them the part reruns with CPU-style stand-in kernels on the GPU and
  says so (``"kernels": "stand-in"``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
try:  # tests/support/deepseek.py declares a pytest fixture; a GPU machine without pytest needs only the decorator
    import pytest  # noqa: F401
except ImportError:
    import types

    sys.modules["pytest"] = types.SimpleNamespace(fixture=lambda *a, **k: (lambda f: f))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def mean_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-30))


DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def part_v41(tmp: Path) -> dict:
    from phaselens.models.deepseek_v41 import load_v41
    from phaselens.models.deepseek_v41.kernels import CALLS, kernel_status
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    out: dict = {}
    ckpt = write_tiny_checkpoint(tmp / "v41", seed=0, n_routed_experts=64, moe_intermediate_size=256)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (2, 300), generator=g)
    with torch.no_grad():
        # fp32: packed == dequantized on the GPU; GPU vs CPU
        p32 = load_v41(ckpt, device=DEV, dtype=torch.float32, index_topk="all")
        d32 = load_v41(ckpt, device=DEV, dtype=torch.float32, index_topk="all", weights="dequantized")
        c32 = load_v41(ckpt, dtype=torch.float32, index_topk="all")
        lp, ld, lc = p32(x), d32(x), c32(x)
        out["fp32_packed_vs_dequantized_rel"] = rel(lp, ld)
        out["fp32_gpu_vs_cpu_rel"] = rel(lp, lc)
        out["fp32_chunked_prefill_vs_one_call_rel"] = rel(p32(x, chunk=64), lp)
        del p32, d32, c32
        # memory of a bf16 load, packed vs dequantized
        mem = {}
        for weights in ("packed", "dequantized") if DEV == "cuda" else ():
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            m = load_v41(ckpt, device=DEV, dtype=torch.bfloat16, index_topk="all", weights=weights)
            mem[weights] = {"held_MiB": (torch.cuda.memory_allocated() - base) / 2**20,
                            "peak_during_load_MiB": (torch.cuda.max_memory_allocated() - base) / 2**20}
            del m
        out["gpu_memory"] = mem
        # bf16: kernels and speed
        models = {
            "dequantized": load_v41(ckpt, device=DEV, dtype=torch.bfloat16, index_topk="all",
                                    weights="dequantized"),
            "packed_torch": load_v41(ckpt, device=DEV, dtype=torch.bfloat16, index_topk="all", kernels="torch"),
            "packed_fp8_torch": load_v41(ckpt, device=DEV, dtype=torch.bfloat16, index_topk="all",
                                         kernels="torch", quantize="fp8"),
            "packed_fp8_auto": load_v41(ckpt, device=DEV, dtype=torch.bfloat16, index_topk="all",
                                        kernels="auto", quantize="fp8"),
            "dequantized_fp8": load_v41(ckpt, device=DEV, dtype=torch.bfloat16, index_topk="all",
                                        weights="dequantized", quantize="fp8"),
        }
        logits = {k: m(x) for k, m in models.items()}
        out["bf16_packed_vs_dequantized_equal"] = bool(torch.equal(logits["packed_torch"], logits["dequantized"]))
        out["bf16_fp8_packed_torch_vs_dequantized_equal"] = bool(
            torch.equal(logits["packed_fp8_torch"], logits["dequantized_fp8"]))
        CALLS.clear()
        models["packed_fp8_auto"](x)
        out["fp8_auto_paths"] = kernel_status()
        out["fp8_auto_vs_torch_rel"] = rel(logits["packed_fp8_auto"], logits["packed_fp8_torch"])
        out["fp8_auto_vs_torch_mean_rel"] = mean_rel(logits["packed_fp8_auto"], logits["packed_fp8_torch"])
        long = torch.randint(0, 128, (1, 512), generator=g)
        steps = torch.randint(0, 128, (1, 16), generator=g)
        speed = {}
        for k in ("dequantized", "packed_torch", "dequantized_fp8", "packed_fp8_auto"):
            m = models[k]
            pre = timed(lambda m=m: m(long, logits="query", query_len=1), repeats=2)

            def decode(m=m):
                cache = m.new_cache(1)
                m(long[:, :64], cache=cache, logits="query", query_len=1)
                for i in range(steps.shape[1]):
                    m(steps[:, i : i + 1], cache=cache)
            dec = timed(decode, 2) - timed(lambda m=m: m(long[:, :64], logits="query", query_len=1), 2)
            speed[k] = {"prefill_tokens_per_s": long.shape[1] / pre, "decode_tokens_per_s": steps.shape[1] / dec}
        out["bf16_speed"] = speed
        del models
        # device maps
        ref = load_v41(ckpt, device=DEV, dtype=torch.float32, index_topk="all")
        want = ref(x)
        gpu0 = 0 if DEV == "cuda" else "cpu"
        maps = {"auto": "auto",
                "offload_last_layers_to_cpu": {"embed": gpu0, "hook_embed": gpu0, **{f"blocks.{i}": gpu0 for i in range(4)},
                                               **{f"blocks.{i}": "cpu" for i in range(4, 7)}, "norm": "cpu",
                                               "head": "cpu"}}
        if torch.cuda.device_count() > 1:
            maps["two_gpus"] = {"embed": 0, "hook_embed": 0, **{f"blocks.{i}": i // 4 for i in range(7)},
                                "norm": 1, "head": 1}
        dm = {}
        for name, device_map in maps.items():
            try:
                m = load_v41(ckpt, dtype=torch.float32, index_topk="all", device_map=device_map)
                got = m(x)
                cache = m.new_cache(2)
                dec = torch.cat([m(x[:, :200], cache=cache), m(x[:, 200:201], cache=cache),
                                 m(x[:, 201:], cache=cache)], dim=1)
                dm[name] = {"rel_vs_one_gpu": rel(got, want), "cached_vs_forward_rel": rel(dec, want),
                            "devices": sorted({str(v) for v in m.hf_device_map.values()})}
            except Exception as err:  # report, do not stop the check
                dm[name] = {"error": f"{type(err).__name__}: {err}"}
        out["device_maps"] = dm
    return out


def part_v4() -> dict:
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        import transformers

        return {"skipped": f"transformers {transformers.__version__} has no DeepSeek-V4; install >= 5.24"}
    import phaselens
    from tests.support.deepseek_packed import cpu_kernels, packed_tiny_v4

    out: dict = {}
    dense, packed = packed_tiny_v4(0, dtype=torch.bfloat16, watch=False)
    packed = packed.to(DEV)
    x = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    names = ["blocks.1.attn.hook_z", "blocks.3.attn.hook_z"]

    def run_all(kernels: str) -> dict:
        res = {"kernels": kernels}
        for numerics in ("reference", "transformers"):
            for quantize in (None, "fp8"):
                kw = {"numerics": numerics, "quantize": quantize, "index_topk": "all"}
                a, b = phaselens.from_hf(dense, **kw), phaselens.from_hf(packed, **kw)
                la, ca = a.run_with_cache(x, names_filter=names)
                lb, cb = b.run_with_cache(x.to(DEV), names_filter=names)
                key = f"{numerics}/{quantize}"
                res[key] = {"logits_rel": rel(lb, la), "logits_mean_rel": mean_rel(lb, la),
                            "top1_agree": float((lb.argmax(-1).cpu() == la.argmax(-1)).float().mean()),
                            "hook_z_mean_rel": max(mean_rel(cb[n], ca[n]) for n in names)}
        return res

    with torch.no_grad():
        try:
            out["transformers_kernels"] = run_all("transformers")
        except Exception as err:
            out["transformers_kernels"] = {"error": f"{type(err).__name__}: {err}"[:600]}
            with cpu_kernels():
                out["stand_in_kernels"] = run_all("stand-in")
    return out


def main() -> None:
    global DEV
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    DEV = ap.parse_args().device
    t0 = time.time()
    result: dict = {"check": "gpu_packed_check", "device": DEV}
    if DEV == "cuda" and not torch.cuda.is_available():
        result["error"] = "no CUDA device"
        print(json.dumps(result))
        sys.exit(1)
    import transformers

    result["env"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                     "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else None,
                     "gpus": torch.cuda.device_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("v41", lambda: part_v41(Path(tmp))), ("v4", part_v4)):
            t = time.time()
            try:
                result[name] = fn()
            except Exception:
                result[name] = {"error": traceback.format_exc()[-1500:]}
            result[name]["seconds"] = round(time.time() - t, 1)
    result["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_packed_check.json").write_text(text)


if __name__ == "__main__":
    main()
