"""DeepSeek-V4.1's Engram: the compressed vocabulary, the n-gram hashes, the FP8 table, the gate, and the whole
model's logits against an Engram computed here from the raw checkpoint tensors (tiny checkpoints)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open

import phaselens
from phaselens.errors import CheckpointError, InputError
from phaselens.models.deepseek_v41 import IndexTopKWarning, load_v41
from phaselens.models.deepseek_v41.engram import EngramTable, engram_gate
from phaselens.models.deepseek_v41.engram_hash import (
    EngramLayout,
    NgramHasher,
    compressed_token_map,
    engram_primes,
    hash_multipliers,
)
from tests.support.deepseek_v41 import (
    ENGRAM_TEXT,
    TINY_TEXT,
    expected_compressed_vocab,
    tiny_tokenizer,
    write_tiny_checkpoint,
)

T = 21
PRIMES = {1: [[31, 37], [41, 43]], 2: [[47, 53], [59, 61]]}  # ENGRAM_TEXT's layout, listed by hand


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41e") / "tiny-v41-engram", engram=True)


def load(root, **kw):
    kw.setdefault("dtype", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        warnings.simplefilter("ignore", phaselens.models.deepseek_v41.EngramDroppedWarning)
        return load_v41(root, **kw)


@pytest.fixture(scope="module")
def model(ckpt):
    return load(ckpt)


@pytest.fixture(scope="module")
def dropped(ckpt):
    return load(ckpt, engram="drop")


def tokens(b=2, n=T, seed=0):
    return torch.randint(0, TINY_TEXT["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))


# ---- hashing -----------------------------------------------------------------------------------------
def test_compressed_vocabulary_merges_what_normalization_merges(ckpt):
    """Case, accents (precomposed or combining), NFKC forms and whitespace runs merge; a lone combining accent
    (normalizes to nothing) and lone UTF-8 bytes (decode to U+FFFD) stay apart. Expected ids by construction."""
    lookup, size = compressed_token_map(ckpt / "tokenizer.json")
    tok, groups = tiny_tokenizer()
    # 3 special tokens + 9 families + 2 lone accents + 3 lone bytes + 85 filler words
    assert size == len(groups) == 3 + 9 + 2 + 3 + 85 == expected_compressed_vocab()
    want = torch.empty(128, dtype=torch.long)
    for k, ids in enumerate(groups):
        want[ids] = k
    assert torch.equal(lookup, want)
    by_text = {tok.decode([i], skip_special_tokens=False): int(lookup[i]) for i in range(128)}
    assert by_text["The"] == by_text[" the"] == by_text["\tthe"] == by_text["THE"]
    assert by_text[" "] == by_text["\n"] == by_text["  "] == by_text["\r\n"] != by_text["the"]
    assert by_text["\ufb01"] == by_text["fi"] and by_text["x\u00b2"] == by_text["x2"] and by_text["\u2126"] == by_text["\u03c9"]
    assert by_text["\u0301"] != by_text["\u0300"]


def test_primes_reproduce_the_released_table_sizes():
    """Released Flash: Engram at layers 1 and 14, 2- to 4-grams, 8 heads, engram_vocab_size 16,000,000; its
    config.json states 384,006,168 and 384,016,682 table rows (the sums of each layer's primes)."""
    primes = engram_primes(2, 4, 8, 16_000_000)
    assert [sum(map(sum, layer)) for layer in primes] == [384_006_168, 384_016_682]
    flat = [p for layer in primes for size in layer for p in size]
    assert len(set(flat)) == 48 and all(p > 16_000_000 - 1 for p in flat)
    assert engram_primes(2, 3, 2, 31) == [PRIMES[1], PRIMES[2]]


def python_hashes(ids, layer, max_ngram, primes, compressed_vocab, pad):
    """Hash rows of compressed ids ``ids`` (a list) at one layer, with Python integers, position by position."""
    bound = (2**63 - 1) // compressed_vocab // 2
    mult = [int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram,
                                                                                   dtype=np.int64)]
    offsets, acc = [], 0
    for size in primes:
        for p in size:
            offsets.append(acc)
            acc += p
    out = []
    for t in range(len(ids)):
        h, row = 0, []
        for s in range(max_ngram):
            h ^= (ids[t - s] if t - s >= 0 else pad) * mult[s]
            if s >= 1:
                row += [h % p for p in primes[s - 1]]
        out.append([r + o for r, o in zip(row, offsets)])
    return out


def test_hashes_match_a_hand_computation():
    layout = EngramLayout((1, 2), (152, 220), 3, 2, 32, tuple(tuple(map(tuple, PRIMES[k])) for k in (1, 2)))
    V, pad_token = 10, 2
    token_map = torch.tensor([0, 1, 2, 3, 3, 4, 5, 6, 7, 8])  # tokens 3 and 4 normalize alike
    hasher = NgramHasher(layout, token_map, V - 1, pad_token)
    toks = torch.tensor([[4, 7, 5, 9, 3, 0], [1, 1, 2, 8, 6, 3]])
    ids = hasher.compress(toks)
    rows = hasher(ids, ids[:, :0])  # [B, n, layers, cols]
    assert rows.shape == (2, 6, 2, 4)
    for b in range(2):
        for k, layer in enumerate((1, 2)):
            want = python_hashes(token_map[toks[b]].tolist(), layer, 3, PRIMES[layer], V - 1, int(token_map[pad_token]))
            assert rows[b, :, k].tolist() == want
    # rows stay inside each head's range: [offset, offset + prime)
    lo = torch.tensor([[0, 31, 68, 109], [0, 47, 100, 159]])
    width = torch.tensor([[31, 37, 41, 43], [47, 53, 59, 61]])
    assert ((rows >= lo) & (rows < lo + width)).all()
    # the same rows when the first 4 slots come from the cache's history (only the last 2 ids are kept)
    assert torch.equal(hasher(ids[:, 4:], ids[:, 2:4]), rows[:, 4:])
    assert torch.equal(hasher(ids[:, 1:], ids[:, :1]), rows[:, 1:])
    mult = hash_multipliers((1, 2), 3, V - 1)
    assert (mult % 2 == 1).all() and int(mult.max()) * (V - 2) < 2**63  # odd, and no int64 overflow


# ---- the table and the gate ------------------------------------------------------------------------
def test_table_rows_are_dequantized_per_32_values_and_read_in_bf16():
    table = EngramTable(3, 64)
    values = torch.tensor([1.5, -448.0, 0.013671875, 2.75]).repeat(48).reshape(3, 64)  # E4M3-exact values
    scales = torch.tensor([[2.0**-3, 2.0**4], [1.0, 2.0**-10], [2.0**7, 0.5]])
    with torch.no_grad():
        table.weight.copy_(values.to(torch.float8_e4m3fn))
        table.scale.copy_(scales.to(torch.float8_e8m0fnu))
    out = table(torch.tensor([[2, 0], [1, 1]]))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 2, 64)
    # value j of a row is values[j % 4]; values 0-31 take the row's first scale, 32-63 its second
    assert out[0, 1, 0] == 1.5 / 8 and out[0, 1, 33] == -448.0 * 16 and out[0, 0, 0] == 1.5 * 128
    assert out[1, 0, 42] == 0.013671875 * 2.0**-10 and out[0, 0, 34] == 0.013671875 / 2  # an E4M3 subnormal
    want = (values.unflatten(-1, (2, 32)) * scales.unsqueeze(-1)).flatten(-2)
    assert torch.equal(out[1, 1].float(), want[1]) and torch.equal(out[0, 0].float(), want[2])


def test_gate_is_a_sigmoid_of_a_signed_square_root():
    eps = 1e-20
    f64 = dict(dtype=torch.float64)
    x = torch.tensor([[[1.0, 1.0], [3.0, 4.0], [1.0, 1.0], [1.0, 0.0]]], **f64)  # 4 streams, D = 2
    key = torch.tensor([[[1.0, 1.0], [4.0, 3.0], [-1.0, -1.0], [0.0, 1.0]]], **f64)
    w = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [2.0, 5.0]], **f64)
    g = engram_gate(x, key, w, eps)[0]
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    # dot = sum(x * w * k) / (rms(x) rms(k) sqrt(D)): 2 / (1 * 1 * sqrt 2) = sqrt 2; 24 / (12.5 sqrt 2)
    assert g[0].item() == pytest.approx(sig(2**0.25), rel=1e-12)
    assert g[1].item() == pytest.approx(sig(math.sqrt(24 / 12.5 / math.sqrt(2))), rel=1e-12)
    assert g[2].item() == pytest.approx(sig(-(2**0.25)), rel=1e-12)  # a negative dot closes the gate below 1/2
    assert g[3].item() == pytest.approx(sig(1e-3), rel=1e-12)  # |dot| = 0 is floored at 1e-6 before the root


# ---- the whole model ---------------------------------------------------------------------------------
def read_raw(root, names):
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for n in names:
        with safe_open(str(root / index[n]), framework="pt") as f:
            out[n] = f.get_tensor(n)
    return out


def reference_engram(root, layer, toks):
    """Engram of one layer computed here, in fp64, from the raw tensors: ``(fn(x) -> x + g v)`` for a hook."""
    p = f"layers.{layer}.engram."
    raw = read_raw(root, [p + "embed.weight", p + "embed.scale", p + "wkv.weight", p + "wkv.scale",
                          p + "q_weight", p + "k_weight"])
    _, groups = tiny_tokenizer()
    cid = {i: k for k, ids in enumerate(groups) for i in ids}
    V = len(groups)
    table = (raw[p + "embed.weight"].double().unflatten(-1, (-1, 32)) * raw[p + "embed.scale"].double().unsqueeze(-1))
    table = table.flatten(-2).to(torch.bfloat16).double()
    w = raw[p + "wkv.weight"].double()
    s = raw[p + "wkv.scale"].double().repeat_interleave(32, 0)[: w.shape[0]].repeat_interleave(32, 1)[:, : w.shape[1]]
    wkv = w * s
    qk = raw[p + "q_weight"].double() * raw[p + "k_weight"].double()
    hc, D = qk.shape
    rows = torch.tensor([python_hashes([cid[int(t)] for t in seq], layer, 3, PRIMES[layer], V, cid[2]) for seq in toks])
    kv = table[rows].flatten(-2) @ wkv.T  # [B, n, (hc + 1) D]
    key, value = kv[..., : hc * D].unflatten(-1, (hc, D)), kv[..., hc * D :]

    def hook(x, hook):
        h = x.double()
        rstd = torch.rsqrt(h.square().mean(-1) + 1e-20) * torch.rsqrt(key.square().mean(-1) + 1e-20)
        dot = (h * qk * key).sum(-1) * rstd / math.sqrt(D)
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
        return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)

    return hook


def test_logits_with_engram_equal_an_engram_computed_independently(ckpt, model, dropped):
    """The model without Engram, plus Engram added at hook_resid_pre of layers 1 and 2 by the fp64 computation
    above (own hashes, own dequantization, own gate), gives the Engram model's logits. Tolerance 1e-5 of the
    largest logit: fp32 rounding of the lookup and projection (measured ~1e-6)."""
    toks = tokens()
    hooks = [(f"blocks.{layer}.hook_resid_pre", reference_engram(ckpt, layer, toks))
             for layer in ENGRAM_TEXT["engram_layer_ids"]]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        ours = model(toks)
        theirs = dropped.run_with_hooks(toks, fwd_hooks=hooks)
        plain = dropped(toks)
    scale = ours.abs().max()
    assert (ours - theirs).abs().max() < 1e-5 * scale
    assert (ours - plain).abs().max() > 0.1 * scale  # Engram changes the logits a lot: the test can fail


def test_engram_hooks_shapes_and_ablation(model, dropped):
    toks = tokens()
    names = [f"blocks.1.engram.hook_{s}" for s in ("rows", "key", "value", "gate", "out")] + ["blocks.1.hook_resid_pre",
                                                                                               "blocks.0.hook_resid_post"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        _, c = model.run_with_cache(toks, names_filter=names)
    B, D, hc = 2, TINY_TEXT["hidden_size"], TINY_TEXT["hc_mult"]
    assert c["blocks.1.engram.hook_rows"].shape == (B, T, 4) and c["blocks.1.engram.hook_rows"].dtype == torch.int64
    assert c["blocks.1.engram.hook_key"].shape == (B, T, hc, D) and c["blocks.1.engram.hook_value"].shape == (B, T, D)
    gate, out = c["blocks.1.engram.hook_gate"], c["blocks.1.engram.hook_out"]
    assert gate.shape == (B, T, hc) and ((gate > 0) & (gate < 1)).all()
    assert torch.allclose(out, gate.unsqueeze(-1) * c["blocks.1.engram.hook_value"].unsqueeze(-2))
    assert torch.allclose(c["blocks.1.hook_resid_pre"], c["blocks.0.hook_resid_post"] + out, atol=1e-6)
    assert "blocks.0.engram.hook_gate" not in model.hook_dict and "blocks.3.engram.hook_gate" not in model.hook_dict
    # zeroing what Engram adds at both layers is the model without Engram
    zero = [(f"blocks.{i}.engram.hook_out", lambda t, hook: torch.zeros_like(t)) for i in (1, 2)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        ablated = model.run_with_hooks(toks, fwd_hooks=zero)
        plain = dropped(toks)
    assert (ablated - plain).abs().max() < 1e-5
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


def test_cached_decoding_carries_the_ngram_history(model):
    toks = tokens()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        full = model(toks)
        cache, outs = model.new_cache(2), []
        for i, j in zip([0, 1, 2, 7, 8, 14], [1, 2, 7, 8, 14, T]):
            outs.append(model(toks[:, i:j], cache=cache))
    assert (torch.cat(outs, 1) - full).abs().max() < 2e-5  # as test_forward_equals_cached_decode
    assert cache.ngram_history.shape == (2, 2)


def test_truncation_keeps_the_engram_layers_before_the_cut(ckpt, model):
    small = load(ckpt, n_layers=2)
    assert small.cfg.engram_layer_ids == (1,) and hasattr(small.blocks[1], "engram")
    name = "blocks.1.hook_resid_post"
    _, a = small.run_with_cache(tokens(), names_filter=name)
    _, b = model.run_with_cache(tokens(), names_filter=name)
    assert torch.equal(a[name], b[name])


def test_tokenizer_problems_raise_clear_errors(tmp_path):
    root = write_tiny_checkpoint(tmp_path / "no-tok", engram=True, tokenizer=False)
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json.*engram='drop'"):
        load_v41(root)
    assert load(root, engram="drop").analysis_metadata["engram"] == "dropped"
    root = write_tiny_checkpoint(tmp_path / "wrong-size", engram=True, engram_compressed_vocab_size=101)
    with pytest.raises(CheckpointError, match="normalizes to 102 distinct tokens.*101"):
        load_v41(root)
    # a tokenizer with fewer tokens than the model's vocabulary: ids beyond it cannot be hashed
    root = write_tiny_checkpoint(tmp_path / "short", engram=True, engram_compressed_vocab_size=expected_compressed_vocab(120))
    tiny_tokenizer(120)[0].save(str(root / "tokenizer.json"))
    model = load(root)
    model(torch.tensor([[5, 119]]))
    with pytest.raises(InputError, match="beyond the tokenizer's 120 tokens"):
        model(torch.tensor([[5, 125]]))
    with pytest.raises(CheckpointError, match="need 152 table rows"):
        write_tiny_checkpoint(tmp_path / "rows", engram=True, engram_num_embeddings=[150, 220])
        load_v41(tmp_path / "rows")
