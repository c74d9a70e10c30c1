"""What ``from_transformers(numerics=..., quantize=...)`` costs and changes on a bf16 DeepSeek-V4, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_v4_numerics [--tokens 1024] [--hidden 1024]
    .venv/bin/python -m benchmarks.bench_v4_numerics --device cuda --tokens 4096      # on a GPU

A random V4 (sliding, CSA 4, HCA 16, CSA 4; head_dim 512 with 64 RoPE dims, index_head_dim 128, as released)
is saved and loaded back in bf16, as ``from_pretrained`` loads a checkpoint, and once more in fp32 from the
same bf16 weights: the fp32 run is the truth (in fp32, transformers agrees with DeepSeek's reference to ~1e-7).
Reported: the compressed entries' relative Frobenius error against it (each compressor fed the same hidden
states), the relative change FP8 makes to the window KV and to the logits, how many indexer picks FP4
(``quantize="published"``) and FP8 + FP4 (``"fp8"``) change and the share of picks the adapter reports as
fragile, and the forward time of each setting (best of interleaved turns). Also, from the released Flash
config on the meta device, the share of the active parameters that the fp32 projections touch.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

from benchmarks.common import emit, interleaved_times
from phaselens.models.deepseek_v4 import from_transformers


def build(hidden: int, seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = DeepseekV4Config(
            vocab_size=1000, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=16, head_dim=512,
            qk_rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=128, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=256, sliding_window=128, index_n_heads=16,
            index_head_dim=128, index_topk=32,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1},
        )
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("position_bias") or name.endswith("sinks"):
                    p.normal_(0.0, 0.5)
        path = tempfile.mkdtemp()
        model.save_pretrained(path)

        def load(dtype: torch.dtype, device: str = "cpu"):
            model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
            return model.to(device).eval()

    return load


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


@torch.no_grad()
def entries(model, layer: int, h: torch.Tensor) -> torch.Tensor:
    comp = model.model.layers[layer].self_attn.compressor
    T = h.shape[1]
    q_res = torch.zeros(1, T, int(model.config.q_lora_rank), dtype=h.dtype)
    return comp(h, q_res, torch.arange(T)[None], None, layer)[0][:, 0]


def flash_share() -> dict[str, float]:
    """Parameters of the compressors' projections in the released Flash, against its active parameters."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    facts = dict(hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
                 q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6,
                 moe_intermediate_size=2048, index_n_heads=64, index_head_dim=128, vocab_size=129280,
                 compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**facts))
    proj = sum(p.numel() for n, p in model.named_parameters() if "compressor" in n and n.endswith("_proj.weight")
               and ("kv_proj" in n or "gate_proj" in n))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()  # a lookup, not a product
    active = total - embed - experts + experts * 6 / 256
    return {"flash_fp32_projection_params": proj, "flash_active_matmul_params": active,
            "flash_fp32_share_of_active": proj / active}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = args.device
    load = build(args.hidden)
    truth_model = load(torch.float32, dev)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, args.tokens, args.hidden, generator=g).bfloat16().to(dev)
    tokens = torch.randint(0, 1000, (1, args.tokens), generator=g).to(dev)
    with torch.no_grad():
        truth_logits = truth_model(tokens).logits

    out: dict[str, object] = {"tokens": args.tokens, "hidden": args.hidden, "head_dim": 512, "index_head_dim": 128,
                              "device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev}
    settings = {"transformers": ("transformers", None), "reference": ("reference", None),
                "reference_published": ("reference", "published"), "reference_fp8": ("reference", "fp8")}
    adapters, picks = {}, {}
    for key, (numerics, quantize) in settings.items():
        model = load(torch.bfloat16, dev)
        adapters[key] = from_transformers(model, numerics=numerics, quantize=quantize)
        for layer, kind in ((1, "csa"), (2, "hca")):
            out[f"entries_rel_err_{kind}_{key}"] = rel(entries(model, layer, h), entries(truth_model, layer, h.float()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits, cache = adapters[key].run_with_cache(tokens, names_filter=["blocks.0.attn.hook_kv"])
        out[f"logits_rel_err_{key}"] = rel(logits, truth_logits)
        picks[key] = adapters[key].indexer_picks
        if key == "reference":
            kv_plain = cache["blocks.0.attn.hook_kv"]
        if key == "reference_fp8":
            out["window_kv_rel_change_fp8"] = rel(cache["blocks.0.attn.hook_kv"], kv_plain)
    for key in ("reference_published", "reference_fp8"):
        for layer in picks["reference"]:
            a, b = picks["reference"][layer], picks[key][layer]
            same = (a.sort(-1).values == b.sort(-1).values).all(-1).float().mean()  # identical pick sets per query
            out[f"indexer_query_rows_with_changed_picks_{key}_layer{layer}"] = 1.0 - float(same)
            valid = a >= 0
            kept = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1) & valid  # a pick of one run that the other made too
            out[f"indexer_picks_changed_{key}_layer{layer}"] = 1.0 - float(kept.sum() / valid.sum())
        out[f"fragile_picks_{key}"] = adapters[key].analysis_metadata["index_topk_fragile_picks"]

    def run(key: str):
        def f() -> None:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                adapters[key](tokens)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
        return f

    for key in settings:
        run(key)()  # warm-up
    times = interleaved_times({k: run(k) for k in settings}, repeats=3)
    out.update({f"forward_s_{k}": v for k, v in times.items()})
    out["reference_over_transformers"] = times["reference"] / times["transformers"]
    out["reference_published_over_transformers"] = times["reference_published"] / times["transformers"]
    out["reference_fp8_over_transformers"] = times["reference_fp8"] / times["transformers"]
    if dev.startswith("cuda"):  # the fused bf16 x bf16 -> fp32 products against upcasting first
        from phaselens.models.deepseek_v4.reference_ops import _FUSED, products

        a = torch.randn(16, 1024, 512, device=dev).bfloat16()
        b = torch.randn(16, 512, 1280, device=dev).bfloat16()
        fused = products(a, b)
        out["cuda_fused_products"] = _FUSED.get("cuda", True)
        out["cuda_fused_products_max_rel_diff"] = float(
            (fused - a.float() @ b.float()).abs().max() / fused.abs().max())
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out.update(flash_share())
    emit("bench_v4_numerics", out)


if __name__ == "__main__":
    main()
