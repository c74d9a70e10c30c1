"""Compare phaselens' DeepSeek-V4.1 with DeepSeek's official inference code, logit by logit. Fetches nothing.

phaselens vendors none of DeepSeek's code. Point ``--reference`` at a local copy of the official ``inference/``
directory of DeepSeek-V4.1-Flash (it holds ``model.py`` and ``engram.py``; the script prints their sha256, and
for revision dba1be0a they are ``4e9ae236...6f65`` and ``11f35ecb...3897``). The script imports them at run time.

Two sources of weights:

* ``--tiny``: a tiny random checkpoint in the official layout, written by ``tests/support/deepseek_v41.py`` (FP8 / FP4
  weights, Engram tables, a 128-token tokenizer built in code), run on CPU. The official ``kernel.py`` is
  TileLang / CUDA (and V4.1's is not public), so the reference runs on ``tests/reference/v41_kernels.py``,
  a CPU emulation of its kernel API (see that file for its options).
* ``--ckpt DIR``: a local checkpoint (the released weights), the first ``--n-layers`` layers; with
  ``--kernels official`` the reference uses ``kernel.py`` from ``--reference`` (a CUDA GPU and TileLang).

Per configuration (``--dtype``, ``--quantize``, ``--engram``; ``--matrix`` runs the table of
``docs/deepseek_v41.md``), both models prefill ``--prompt-len`` random tokens and then decode ``--decode``
more one at a time; the JSON gives max / mean relative logit differences (``|delta|`` over the largest / the
mean ``|reference logit|``), the median over positions of each position's max relative difference, and top-1
agreement, for the prefill rows and the decode steps, against phaselens' parallel forward and against its
cached decoding. ``--floor`` (on with ``--matrix``) adds the reference against itself under other legitimate
kernel emulations (attention key blocks of 8 instead of 64; in bf16 also fp32 attention probabilities): the
size of difference that says nothing about either implementation.

**A bug in the reference's decoding.** A KV source's indexer publishes its index keys to the shared slot
(``shared_attn.index_k = self.k_cache``) only in a call that completed one of its groups. When a decode step
leaves a ratio-2 group open, the indexers of the ratio-2 sources (2, 8, 14 on Flash) therefore score against the
keys that the last publisher (the ratio-1 source 20, in the previous step) left there, and layers 2-19 attend
to entries picked by another layer's keys at every other decode step. Its prefill is unaffected. phaselens
computes what the prefill computes. The script reports decoding against the reference as published
(``decode_as_published``) and with that one publication made unconditional (``decode``; the harness's only
change to the reference's logic, applied by wrapping ``Indexer.forward``).

How phaselens' options map onto the reference: ``quantize=None`` is the reference with its in-place KV round
trips switched off in the emulated kernels (``round_trips="off"``); ``quantize="kv"`` the reference with bf16
weights (its KV round trips on); ``quantize="fp8"`` the reference with FP8 / FP4 weights and FP8 activations
into those GEMMs, as released. ``--dtype float32`` runs the reference with torch's default dtype fp32 and its
bf16 weights upcast (exact); its only other change is that a bf16 input to an fp32 weight is upcast (exact),
which happens at Engram's ``wkv`` alone (the reference reads the table rows in bf16). The reference's head
is asked for every position's logits during prefill (``full_logits=True``).

On the released weights the two models run one after the other (an Engram table is 98 GB in FP8). phaselens
still dequantizes the routed experts (27 GB per layer in bf16; packed experts are issue 28), so on one H200
use ``--n-layers 3 --engram drop``; with Engram, ``--n-layers 2`` needs about 160 GB for phaselens.

Usage:

    python -m tests.reference.v41_parity --reference /data/DeepSeek-V4.1-Flash/inference --tiny --matrix
    python -m tests.reference.v41_parity --reference /data/DeepSeek-V4.1-Flash/inference --ckpt /data/DeepSeek-V4.1-Flash \\
        --kernels official --device cuda --dtype bfloat16 --quantize fp8 --n-layers 3 --prompt-len 300 --decode 8
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import sys
import tempfile
import types
import warnings
from dataclasses import fields
from pathlib import Path

import torch

from phaselens.models.deepseek_v41 import load_v41
from phaselens.models.deepseek_v41.weights import normalize, shard_map
from tests.reference import v41_kernels as emulated

# text_config (Hugging Face names) -> the reference's ModelArgs
ARGS = dict(vocab_size="vocab_size", dim="hidden_size", moe_inter_dim="moe_intermediate_size", n_layers="num_hidden_layers",
            n_heads="num_attention_heads", n_routed_experts="n_routed_experts", n_shared_experts="n_shared_experts",
            n_activated_experts="num_experts_per_tok", score_func="scoring_func", norm_topk_prob="norm_topk_prob",
            route_scale="routed_scaling_factor", swiglu_limit="swiglu_limit", q_lora_rank="q_lora_rank",
            head_dim="head_dim", rope_head_dim="qk_rope_head_dim", norm_eps="rms_norm_eps", o_groups="o_groups",
            o_lora_rank="o_lora_rank", window_size="sliding_window", compress_ratios="compress_ratios",
            kv_source_layers="kv_source_layer_ids", index_source_layers="index_source_layer_ids",
            compress_rope_theta="compress_rope_theta", rope_theta="rope_theta", index_n_heads="index_n_heads",
            index_head_dim="index_head_dim", index_topk="index_topk", candidate_source_layer="candidate_source_layer_id",
            candidate_topk_blocks="candidate_topk_blocks", candidate_block_size="candidate_block_size",
            hc_mult="hc_mult", hc_sinkhorn_iters="hc_sinkhorn_iters", hc_eps="hc_eps", gate_temp="gate_temp",
            n_mtp_layers="num_nextn_predict_layers", engram_layer_ids="engram_layer_ids",
            engram_num_embeddings="engram_num_embeddings", engram_max_ngram_size="engram_max_ngram_size",
            engram_vocab_size="engram_vocab_size", engram_n_heads="engram_n_heads", engram_head_dim="engram_head_dim",
            engram_pad_id="engram_pad_token_id", engram_compressed_vocab_size="engram_compressed_vocab_size")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the tiny comparison: enough indexer heads that no two entries tie at 0 after the ReLU (torch.topk's order among
# ties is unspecified), a binding top-k and candidate filter, Engram before layers 1 and 2
TINY = dict(index_n_heads=16, index_head_dim=32)


# ---- the reference ---------------------------------------------------------------------------------
@functools.cache
def import_reference(ref_dir: Path, kernels: str) -> types.ModuleType:
    """Import the official ``model.py`` with ``engram.py`` beside it and the chosen ``kernel`` module (once)."""
    names = ("engram", "image_processor", "vision", "model")
    if kernels == "official":  # the copy's own kernel.py, loaded from its file as the others are
        names = ("kernel", *names)
    else:
        sys.modules["kernel"] = emulated
    for name in ("image_processor", "vision"):  # the vision path is off; stub it where the copy lacks it
        if not (ref_dir / f"{name}.py").is_file():
            stub = types.ModuleType(name)
            stub.IMAGE = stub.IMAGE_END = stub.IMAGE_NEW_LINE = stub.IMAGE_START = None
            stub.Aligner = stub.ViT = None
            sys.modules[name] = stub
    for name in names:
        if name in sys.modules:  # a stub from above
            continue
        spec = importlib.util.spec_from_file_location(name, ref_dir / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    ref = sys.modules["model"]
    ref.original_linear = ref.linear
    return ref


def reference_args(ref, text: dict, *, n_layers: int, max_seq_len: int, batch: int, quantized: bool, engram: bool):
    raw = {k: text[v] for k, v in ARGS.items() if v in text}
    rope = text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        raw.update(original_seq_len=rope.get("original_max_position_embeddings", 0), rope_factor=rope.get("factor", 1),
                   beta_fast=rope.get("beta_fast", 32), beta_slow=rope.get("beta_slow", 1))
    names = {f.name for f in fields(ref.ModelArgs)}
    args = ref.ModelArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names})
    keep = lambda ids: tuple(i for i in ids if i < n_layers)  # noqa: E731
    n_mtp = len(args.compress_ratios) - args.n_layers
    args.compress_ratios = tuple(args.compress_ratios[:n_layers]) + tuple(args.compress_ratios[args.n_layers:])
    args.n_layers, args.n_mtp_layers = n_layers, n_mtp
    args.kv_source_layers, args.index_source_layers = keep(args.kv_source_layers), keep(args.index_source_layers)
    if args.candidate_source_layer >= n_layers:
        args.candidate_source_layer = -1
    tables = dict(zip(args.engram_layer_ids, args.engram_num_embeddings))
    args.engram_layer_ids = keep(args.engram_layer_ids) if engram else ()
    args.engram_num_embeddings = tuple(tables[i] for i in args.engram_layer_ids)
    args.max_seq_len, args.max_batch_size, args.temperature = max_seq_len, batch, 0.0
    args.dspark_block_size, args.vision_n_layers = 0, 0
    args.dtype, args.expert_dtype = ("fp8", "fp4") if quantized else ("bf16", None)
    return args


def _dequant(t: torch.Tensor, scale: torch.Tensor | None, block: int = 32) -> torch.Tensor:
    """The checkpoint's formats, decoded here (not with phaselens'): FP8 block scales, FP4 row scales."""
    if scale is None:
        return t
    if t.dtype == torch.float8_e4m3fn:
        o, i = t.shape
        return t.float() * scale.float().repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :i]
    return (emulated._unpack_fp4(t).unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)


def publish_index_keys(ref, on: bool) -> None:
    """Make a KV source's indexer publish its keys in every call (the fix above), or restore the original."""
    if not hasattr(ref.Indexer, "original_forward"):
        ref.Indexer.original_forward = ref.Indexer.forward
    original = ref.Indexer.original_forward

    def forward(self, x, qr, latent, start_pos, offset):
        if self.owns_k:
            ref.shared_attn.index_k = self.k_cache
        return original(self, x, qr, latent, start_pos, offset)

    ref.Indexer.forward = forward if on else original


def build_reference(ref, ckpt: Path, args, *, dtype: torch.dtype, device: str):
    """The reference ``Transformer`` filled from the checkpoint's shards."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ckpt)) if args.engram_layer_ids else None
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = ref.Transformer(args, tokenizer)
    finally:
        torch.set_default_dtype(torch.float32)
    files = shard_map(ckpt)
    by_name = {normalize(k): k for k in files}

    def read(name):
        with safe_open(str(files[by_name[name]]), framework="pt", device=device) as f:
            return f.get_tensor(by_name[name])

    state = {}
    for key, param in model.state_dict().items():
        if key not in by_name:
            raise KeyError(f"the checkpoint has no tensor for the reference's {key}")
        t = read(key)
        scale_key = key[: -len("weight")] + "scale"
        if param.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            state[key] = t
        elif param.dtype == torch.float4_e2m1fn_x2:
            state[key] = t.view(torch.float4_e2m1fn_x2)
        else:
            scale = read(scale_key) if key.endswith(".weight") and scale_key in by_name else None
            state[key] = _dequant(t, scale).to(param.dtype)
    model.load_state_dict(state, strict=True)
    upcast = 0
    ref.linear = ref.original_linear
    if dtype == torch.float32:
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()  # exact
        original = ref.original_linear

        def linear(x, weight, bias=None):
            nonlocal upcast
            if weight.dtype == torch.float32 and x.dtype == torch.bfloat16:
                upcast += 1
                x = x.float()  # exact: only Engram's bf16 table rows reach an fp32 weight
            return original(x, weight, bias)

        ref.linear = linear
    model.head.forward = functools.partial(type(model.head).forward, model.head, full_logits=True)
    model.upcasts = lambda: upcast
    model.run_dtype = dtype
    return model.eval()


def run_reference(model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits ``[B, T, V]``: one prefill of ``prompt`` tokens, then one token at a time (torch's default dtype
    set to the model's, as the reference's generate.py does)."""
    torch.set_default_dtype(model.run_dtype)
    try:
        _, logits, _ = model(tokens[:, :prompt], 0)
        rows = [logits.float()]
        for i in range(prompt, tokens.shape[1]):
            _, logits, _ = model(tokens[:, i : i + 1], i)
            rows.append(logits.float().reshape(tokens.shape[0], 1, -1))
    finally:
        torch.set_default_dtype(torch.float32)
    return torch.cat(rows, 1)


# ---- comparison ------------------------------------------------------------------------------------
def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max / mean relative difference, the median over positions of each position's max relative difference
    (robust to a few positions that an FP8 / FP4 rounding flip moved), and top-1 agreement."""
    ours, ref = ours.float().cpu(), ref.float().cpu()
    d = (ours - ref).abs()
    per_row = (d.amax(-1) / ref.abs().amax(-1)).flatten()
    return {"max_abs": float(d.max()), "max_rel": float(d.max() / ref.abs().max()),
            "mean_rel": float(d.mean() / ref.abs().mean()), "median_row_rel": float(per_row.median()),
            "top1": float((ours.argmax(-1) == ref.argmax(-1)).float().mean())}


def phaselens_logits(ckpt: Path, tokens, prompt, *, dtype, quantize, engram, n_layers, device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_v41(ckpt, device=device, dtype=dtype, quantize=quantize, engram=engram, n_layers=n_layers)
        with torch.no_grad():
            full = model(tokens)
            cache = model.new_cache(tokens.shape[0])
            steps = [model(tokens[:, :prompt], cache=cache)]
            steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(prompt, tokens.shape[1])]
    return full, torch.cat(steps, 1), model.analysis_metadata


def reference_logits(ref, ckpt, args, tokens, prompt, *, dtype, device, fix: bool, **kernel_options):
    """One reference run, its model freed afterwards (the released Engram tables are 98 GB each)."""
    publish_index_keys(ref, fix)
    if kernel_options:
        emulated.configure(**kernel_options)
    try:
        model = build_reference(ref, ckpt, args, dtype=dtype, device=device)
        with torch.inference_mode():
            logits = run_reference(model, tokens, prompt).cpu()
        upcasts = model.upcasts()
    finally:
        if kernel_options:
            emulated.configure(probs="bf16", block=64)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return logits, upcasts


def one(a, ref_dir: Path, ckpt: Path, text: dict, *, dtype: str, quantize: str | None, engram: str,
        floor: bool = False) -> dict:
    dt, P = DTYPES[dtype], a.prompt_len
    T = P + a.decode
    ref = import_reference(ref_dir, a.kernels)
    if a.kernels != "official":
        emulated.configure(round_trips="off" if quantize is None else a.round_trips, probs="bf16", block=64)
    n_layers = a.n_layers or text["num_hidden_layers"]
    args = reference_args(ref, text, n_layers=n_layers, max_seq_len=T, batch=a.batch, quantized=quantize == "fp8",
                          engram=engram == "run")
    hi = text["vocab_size"]
    if engram == "run" and args.engram_layer_ids:
        from tokenizers import Tokenizer

        hi = min(hi, Tokenizer.from_file(str(ckpt / "tokenizer.json")).get_vocab_size(with_added_tokens=True))
    tokens = torch.randint(0, hi, (a.batch, T), generator=torch.Generator().manual_seed(a.seed)).to(a.device)
    run = functools.partial(reference_logits, ref, ckpt, args, tokens, P, dtype=dt, device=a.device)
    published, _ = run(fix=False)
    theirs, upcasts = run(fix=True)
    others = {}
    if floor and a.kernels != "official":  # the reference against itself under other legitimate emulations
        others["floor_block8"] = run(fix=True, block=8)[0]
        if dt == torch.bfloat16:
            others["floor_probs_fp32"] = run(fix=True, probs="fp32")[0]
    ours_full, ours_cached, md = phaselens_logits(ckpt, tokens, P, dtype=dt, quantize=quantize, engram=engram,
                                                  n_layers=a.n_layers, device=a.device)
    row = {"dtype": dtype, "quantize": quantize, "engram": engram, "round_trips": "off" if quantize is None else
           (a.round_trips if a.kernels != "official" else "official"),
           "prefill": compare(ours_full[:, :P], theirs[:, :P]), "decode": compare(ours_full[:, P:], theirs[:, P:]),
           "decode_cached": compare(ours_cached[:, P:], theirs[:, P:]),
           "decode_as_published": compare(ours_full[:, P:], published[:, P:]),
           "reference_prefill_fix_changes": float((published[:, :P] - theirs[:, :P]).abs().max()),
           "max_abs_logit": float(theirs.abs().max()), "reference_fp32_upcasts": upcasts,
           "phaselens_engram": md["engram"]}
    for key, other in others.items():
        row[key] = {"prefill": compare(other[:, :P], theirs[:, :P]), "decode": compare(other[:, P:], theirs[:, P:]),
                    "phaselens_vs_it": compare(ours_full, other)}
    return row


def config_mismatches(ckpt: Path, ref, text: dict) -> dict | None:
    """Where the script's reading of config.json (text_config) differs from the checkpoint's inference/config.json."""
    flat = ckpt / "inference" / "config.json"
    if not flat.is_file():
        return None
    theirs = json.loads(flat.read_text())
    mine = reference_args(ref, text, n_layers=text["num_hidden_layers"], max_seq_len=1, batch=1, quantized=True,
                          engram=True)
    out = {}
    for k, v in theirs.items():
        if hasattr(mine, k) and k not in ("max_seq_len", "max_batch_size", "temperature", "dtype", "expert_dtype",
                                          "dspark_block_size", "vision_n_layers"):
            mv = getattr(mine, k)
            if (tuple(v) if isinstance(v, list) else v) != mv:
                out[k] = {"inference/config.json": v, "from text_config": mv}
    return out


MATRIX = [(d, q, e) for e in ("run", "drop") for d in ("float32", "bfloat16") for q in (None, "kv", "fp8")]


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer reads config.json, whose model_type transformers lacks
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", type=Path, required=True, help="the official inference/ directory (model.py, engram.py)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", action="store_true", help="a tiny random checkpoint written here (CPU)")
    src.add_argument("--ckpt", type=Path, help="a local V4.1 checkpoint directory")
    p.add_argument("--kernels", choices=["emulated", "official"], default="emulated")
    p.add_argument("--round-trips", choices=["e4m3", "bf16"], default="e4m3",
                   help="what the emulated in-place FP8 round trip rounds to (see tests/reference/v41_kernels.py)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--quantize", choices=["none", "kv", "fp8"], default="kv")
    p.add_argument("--engram", choices=["run", "drop"], default="run")
    p.add_argument("--matrix", action="store_true", help="every dtype x quantize x engram (the docs' table)")
    p.add_argument("--floor", action="store_true",
                   help="also the reference against itself under other emulations (key blocks of 8; fp32 probabilities)")
    p.add_argument("--embed-std", type=float, default=1.0,
                   help="--tiny: embedding scale (50: residual-dominated, as a trained model; 1: chaotic in bf16)")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--decode", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.kernels == "official" and (a.dtype != "bfloat16" or a.quantize != "fp8" or a.matrix or a.floor):
        p.error("--kernels official runs the released numerics only: --dtype bfloat16 --quantize fp8, no --matrix/--floor")
    hashes = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(a.reference.glob("*.py"))}
    with tempfile.TemporaryDirectory() as tmp:
        if a.tiny:
            from tests.support.deepseek_v41 import write_tiny_checkpoint

            ckpt = write_tiny_checkpoint(Path(tmp) / "tiny-v41", engram=True, embed_std=a.embed_std, **TINY)
        else:
            ckpt = a.ckpt
        text = json.loads((ckpt / "config.json").read_text())["text_config"]
        quantize = None if a.quantize == "none" else a.quantize
        runs = MATRIX if a.matrix else [(a.dtype, quantize, a.engram)]
        rows = [one(a, a.reference, ckpt, text, dtype=d, quantize=q, engram=e, floor=a.floor or a.matrix)
                for d, q, e in runs]
        mismatches = config_mismatches(ckpt, import_reference(a.reference, a.kernels), text)
    print(json.dumps({"reference_sha256": hashes, "checkpoint": f"tiny (embed_std {a.embed_std})" if a.tiny else str(a.ckpt),
                      "kernels": a.kernels, "prompt_len": a.prompt_len, "decode": a.decode, "batch": a.batch,
                      "n_layers": a.n_layers, "config_mismatches": mismatches, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
