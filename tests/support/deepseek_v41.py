"""Tiny random DeepSeek-V4.1 checkpoints in the real on-disk layout (a stable test API).

``write_tiny_checkpoint(path, seed=0)`` writes ``config.json`` (``model_type`` ``deepseek_v41``, the text model
under ``text_config``, a ``quantization_config``), three safetensors shards, ``model.safetensors.index.json`` and
a 128-token ``tokenizer.json`` (:func:`tiny_tokenizer`, built here; with ``tokenizer_config.json`` so that
transformers' ``AutoTokenizer`` reads it too).
Weights use the checkpoint's formats: FP8 (E4M3) with one UE8M0 scale per 32 x 32 block for the attention
projections, the shared expert and ``wo_a``; packed FP4 (E2M1, low nibble first) with one UE8M0 scale per row
and 32 inputs for the routed experts; bf16 for the rest and fp32 for the hyper-connection parameters and sinks.
The encoders here are written independently of the loader's decoders.

Layout (7 layers): 0-1 sliding; 2 a ratio-2 KV + index source; 3 ratio 2, reading layer 2's entries and picks;
4 a ratio-1 KV + index source and the candidate source; 5 ratio 1, an index source without keys of its own
(it scores layer 4's index keys) that applies the candidate filter; 6 ratio 1, reusing layer 5's picks.
One draft (``mtp.0``) tensor is included and must be skipped.

``write_tiny_checkpoint(path, engram=True)`` adds Engram before layers 1 and 2 (:data:`ENGRAM_TEXT`: 2- and
3-grams, 2 heads, tables of 152 and 220 rows of 32 values): FP8 tables with one UE8M0 scale per row and 32
values, an FP8 ``wkv`` with block scales, bf16 ``q_weight`` / ``k_weight``. The other weights are the same as
without Engram (Engram's are drawn from their own generator).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_TEXT: dict[str, Any] = dict(
    model_type="deepseek_v41_text", vocab_size=128, hidden_size=64, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
    o_lora_rank=16, o_groups=2, hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20,
    max_position_embeddings=4096, rope_theta=10000,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 64},
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    sliding_window=8, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 0], compress_rope_theta=160000,
    kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 5], index_n_heads=2, index_head_dim=32,
    index_topk=6, candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=4,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[], engram_num_embeddings=[],
    num_nextn_predict_layers=1,
)
# Engram as in the release (engram_* names of its config.json), at toy size. Primes above engram_vocab_size - 1 =
# 30, never reused: layer 1 takes 31, 37 (2-grams) and 41, 43 (3-grams), layer 2 takes 47, 53 and 59, 61.
ENGRAM_TEXT: dict[str, Any] = dict(
    engram_layer_ids=[1, 2], engram_num_embeddings=[31 + 37 + 41 + 43, 47 + 53 + 59 + 61], engram_max_ngram_size=3,
    engram_n_heads=2, engram_head_dim=32, engram_vocab_size=31, engram_pad_token_id=2,
)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_fp8_blocks(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[O, I]`` -> (E4M3 values, UE8M0 scales ``[ceil(O/b), ceil(I/b)]``), scale = 2^ceil(log2(amax/448))."""
    n_out, n_in = w.shape
    po, pi = -n_out % block, -n_in % block
    g = torch.nn.functional.pad(w.float(), (0, pi, 0, po)).unflatten(0, (-1, block)).unflatten(-1, (-1, block))
    amax = g.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (w.float() / scale.repeat_interleave(block, 0)[:n_out].repeat_interleave(block, 1)[:, :n_in])
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def encode_fp4_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[O, I]`` -> (packed int8 ``[O, I/2]``, low nibble = even column; UE8M0 scales ``[O, I/group]``)."""
    g = w.float().unflatten(-1, (-1, group))
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6.0)))
    v = (g / scale.unsqueeze(-1)).flatten(-2)
    code = (v.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest magnitude (ties are irrelevant here)
    code = code + 8 * (v < 0).long() * (code > 0).long()
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def encode_fp8_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[R, C]`` -> (E4M3 values, UE8M0 scales ``[R, C / group]``), one power-of-two scale per row and group."""
    g = w.float().unflatten(-1, (-1, group))
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0)))
    return (g / scale).flatten(-2).to(torch.float8_e4m3fn), scale.squeeze(-1).to(torch.float8_e8m0fnu)


# ---- the tokenizer ---------------------------------------------------------------------------------
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
# Tokens (as decoded text) that Engram's normalization (NFKC, NFD, strip accents, lowercase, whitespace runs to
# one space, strip, whitespace-only -> one space) must merge, family by family:
FAMILIES: list[list[str]] = [
    ["the", "The", "THE", " the", " The", "\tthe"],
    ["café", "cafe", " Café", "cafe\u0301", "CAFÉ"],        # precomposed and combining accents
    ["ＡＢ", "ab", "Ab", " AB"],                              # fullwidth letters (NFKC)
    ["\ufb01", "fi", "Fi"],                                  # the ligature fi (NFKC)
    [" ", "\t", "\n", "  ", "\r\n", " \n "],               # whitespace only: one space, not empty
    ["naïve", "naive", "Naïve"],
    ["\u2460", "1"],                                         # circled digit one (NFKC)
    ["\u2126", "\u03c9", "\u03a9"],                          # ohm sign, omega, capital omega
    ["x\u00b2", "x2", "X2"],                                 # superscript two (NFKC)
]
# Tokens that stay alone: a combining accent normalizes to nothing and keys on its own text; a lone UTF-8 lead
# or continuation byte decodes to U+FFFD and keys on its raw vocabulary string.
LONE_TEXT = ["\u0301", "\u0300"]
LONE_BYTES = [0xC3, 0xE2, 0x82]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the others to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tiny_tokenizer(vocab_size: int = 128):
    """A byte-level ``tokenizers.Tokenizer`` of ``vocab_size`` tokens and the expected Engram grouping.

    Returns ``(tokenizer, groups)``: ``groups`` lists the token ids of each compressed id, in the order Engram
    numbers them (first appearance), derived from :data:`FAMILIES` by construction, not by normalizing.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    as_token = lambda text: "".join(chars[b] for b in text.encode())  # noqa: E731
    tokens: list[str] = list(SPECIAL)
    group_of: list[int] = [0, 1, 2]
    n_groups = 3
    families = [*FAMILIES, *[[t] for t in LONE_TEXT]]
    order = [(g, t) for g, fam in enumerate(families) for t in fam]
    for g, text in order:  # families interleaved as listed: each family's id is assigned at its first token
        tokens.append(as_token(text))
        group_of.append(n_groups + g)
    n_groups += len(families)
    for b in LONE_BYTES:
        tokens.append(chars[b])
        group_of.append(n_groups)
        n_groups += 1
    i = 0
    while len(tokens) < vocab_size:  # distinct lowercase words fill the rest
        tokens.append(as_token(f"w{i:03d}"))
        group_of.append(n_groups)
        n_groups, i = n_groups + 1, i + 1
    assert len(set(tokens)) == len(tokens) == vocab_size
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=SPECIAL[1]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    groups = [[i for i, g in enumerate(group_of) if g == k] for k in range(n_groups)]
    return tok, groups


def expected_compressed_vocab(vocab_size: int = 128) -> int:
    return len(tiny_tokenizer(vocab_size)[1])


def tiny_tensors(text: dict[str, Any], seed: int = 0, *, std: float = 0.3, embed_std: float = 1.0) -> dict[str, torch.Tensor]:
    """Random weights (float, before quantization) under the reference's names."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, s: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    D, V, H, d = text["hidden_size"], text["vocab_size"], text["num_attention_heads"], text["head_dim"]
    hc, q_rank, groups, o_rank = text["hc_mult"], text["q_lora_rank"], text["o_groups"], text["o_lora_rank"]
    Hi, di, E, F_ = text["index_n_heads"], text["index_head_dim"], text["n_routed_experts"], text["moe_intermediate_size"]
    mix = (2 + hc) * hc
    t: dict[str, torch.Tensor] = {"embed.weight": rnd(V, D, s=embed_std), "norm.weight": 1 + rnd(D, s=0.1),
                                  "head.weight": rnd(V, D, s=D**-0.5)}
    n = text["num_hidden_layers"]
    ratios = text["compress_ratios"]
    for layer in range(n):
        p = f"layers.{layer}."
        for part in ("attn", "ffn"):
            t[p + f"hc_{part}_fn"] = rnd(mix, hc * D, s=0.05)
            t[p + f"hc_{part}_base"] = rnd(mix, s=0.5)
            t[p + f"hc_{part}_scale"] = 1 + rnd(3, s=0.1)
            t[p + f"{part}_norm.weight"] = 1 + rnd(D, s=0.1)
        a = p + "attn."
        t[a + "attn_sink"] = rnd(H, s=0.5)
        t[a + "wq_a.weight"] = rnd(q_rank, D, s=D**-0.5)
        t[a + "q_norm.weight"] = 1 + rnd(q_rank, s=0.1)
        t[a + "wq_b.weight"] = rnd(H * d, q_rank, s=q_rank**-0.5)
        t[a + "wkv.weight"] = rnd(d, D, s=D**-0.5)
        t[a + "kv_norm.weight"] = 1 + rnd(d, s=0.1)
        t[a + "wo_a.weight"] = rnd(groups * o_rank, H * d // groups, s=(H * d // groups) ** -0.5)
        t[a + "wo_b.weight"] = rnd(D, groups * o_rank, s=(groups * o_rank) ** -0.5)
        if layer in text["kv_source_layer_ids"]:
            t[a + "compressor.wkv.weight"] = rnd(d, D, s=D**-0.5)
            t[a + "compressor.norm.weight"] = 1 + rnd(d, s=0.1)
            if ratios[layer] > 1:
                t[a + "compressor.wgate.weight"] = rnd(d, D, s=2 * D**-0.5)
            t[a + "indexer.wk.weight"] = rnd(di, d, s=d**-0.5)
            t[a + "indexer.k_norm.weight"] = 1 + rnd(di, s=0.1)
        if layer in text["index_source_layer_ids"]:
            t[a + "indexer.wq_b.weight"] = rnd(Hi * di, q_rank, s=q_rank**-0.5)
            t[a + "indexer.weights_proj.weight"] = rnd(Hi, D, s=D**-0.5)
        f = p + "ffn."
        t[f + "gate.weight"] = rnd(E, D, s=D**-0.5)
        t[f + "gate.bias"] = rnd(E, s=0.1)
        for e in [*range(E), None]:
            ep = f + ("shared_experts." if e is None else f"experts.{e}.")
            t[ep + "w1.weight"] = rnd(F_, D, s=D**-0.5)
            t[ep + "w2.weight"] = rnd(D, F_, s=F_**-0.5)
            t[ep + "w3.weight"] = rnd(F_, D, s=D**-0.5)
    t["mtp.0.attn_norm.weight"] = torch.ones(D)  # draft layer: present in real checkpoints, skipped by the loader
    t.update(engram_tensors(text, seed))
    return t


def engram_tensors(text: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Engram's weights (float, before quantization), from their own generator so the rest stay as they were."""
    g = torch.Generator().manual_seed(10_000 + seed)
    D, hc, hd = text["hidden_size"], text["hc_mult"], text.get("engram_head_dim", 0)
    cols = (text.get("engram_max_ngram_size", 1) - 1) * text.get("engram_n_heads", 0)
    t: dict[str, torch.Tensor] = {}
    for layer, rows in zip(text["engram_layer_ids"], text["engram_num_embeddings"]):
        p = f"layers.{layer}.engram."
        t[p + "embed.weight"] = torch.randn(rows, hd, generator=g) * 0.5
        t[p + "wkv.weight"] = torch.randn(D * (hc + 1), cols * hd, generator=g) * (cols * hd) ** -0.5 * 2
        t[p + "q_weight"] = 1 + torch.randn(hc, D, generator=g) * 0.3
        t[p + "k_weight"] = 1 + torch.randn(hc, D, generator=g) * 0.3
    return t


FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                "indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
                "shared_experts.w3.weight", "engram.wkv.weight")
FP32_MARKERS = ("hc_", "attn_sink", "gate.bias")


def encode(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store each tensor in its checkpoint format (adds ``.scale`` tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if name.endswith("engram.embed.weight"):
            out[name], out[name[: -len("weight")] + "scale"] = encode_fp8_rows(w)
        elif name.endswith(FP8_SUFFIXES):
            out[name], out[name[: -len("weight")] + "scale"] = encode_fp8_blocks(w)
        elif ".experts." in name:
            out[name], out[name[: -len("weight")] + "scale"] = encode_fp4_rows(w)
        elif any(m in name for m in FP32_MARKERS):
            out[name] = w.float().contiguous()
        else:
            out[name] = w.to(torch.bfloat16).contiguous()
    return out


def write_tiny_checkpoint(path: str | Path, seed: int = 0, *, engram: bool = False, tokenizer: bool = True,
                          embed_std: float = 1.0, **text_overrides: Any) -> Path:
    """Write a tiny V4.1 checkpoint directory at ``path`` and return it (see the module docstring).

    ``embed_std`` scales the embedding (e.g. 50: a residual-dominated model, as a trained one, whose bf16 logits
    are not chaotic); the other weights do not change with it.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    text = {**TINY_TEXT, **(ENGRAM_TEXT if engram else {}), **text_overrides}
    if text["engram_layer_ids"]:
        text.setdefault("engram_compressed_vocab_size", expected_compressed_vocab(text["vocab_size"]))
    if tokenizer:
        tok, _ = tiny_tokenizer(text["vocab_size"])
        tok.save(str(root / "tokenizer.json"))
        (root / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
             "pad_token": SPECIAL[2]}, indent=2))
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
              "quantization_config": QUANT, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config, indent=2))
    stored = encode(tiny_tensors(text, seed, embed_std=embed_std))
    names = sorted(stored)
    shards = [names[i::3] for i in range(3)]  # interleaved: a weight and its scale may sit in different shards
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: stored[k] for k in shard}, str(root / fname))
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in stored.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return root


def decode_stored(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 / FP4 weight decoded to fp32 and its ``.scale`` dropped: the
    same weights stored dequantized. Decoders written from the formats, independent of the loader's."""
    out: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in stored:
            continue
        if scale_name not in stored:
            out[name] = t
            continue
        s = stored[scale_name].float()
        if t.dtype == torch.float8_e4m3fn:  # one scale per 32 x 32 block
            rows = torch.arange(t.shape[0]) // 32
            cols = torch.arange(t.shape[1]) // 32
            out[name] = t.float() * s[rows][:, cols]
        else:  # two E2M1 codes per byte, the first in the low nibble; one scale per row and 32 inputs
            b = t.view(torch.uint8).long()
            codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)
            mag = E2M1[codes & 7]
            value = torch.where(codes >= 8, -mag, mag)
            out[name] = value * s[:, torch.arange(value.shape[1]) // 32]
    return out


def write_dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """Copy the checkpoint at ``src`` to ``dst`` with every quantized weight stored dequantized (fp32, no
    scale), one shard per source shard; ``config.json`` unchanged."""
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        stored.update(load_file(str(shard)))
    save_file(decode_stored(stored), str(dst / "model.safetensors"))
    return dst
