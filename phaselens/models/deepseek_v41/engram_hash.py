"""Engram's n-gram hashing: token ids -> the rows of each Engram layer's table (DeepSeek-V4.1).

Facts from DeepSeek's reference ``inference/engram.py`` (revision dba1be0a of DeepSeek-V4.1-Flash):

* **Compressed vocabulary.** Every token id is decoded alone by the checkpoint's tokenizer (``tokenizer.json``,
  special tokens kept) and normalized: NFKC, NFD, accents stripped, lowercase, runs of spaces / tabs / newlines
  collapsed to one space, surrounding spaces stripped, except that a token that is only whitespace stays one
  space. Tokens that normalize alike share one id, numbered in order of first appearance; a token that
  normalizes to nothing keeps its decoded text as its key, and one whose decoding holds U+FFFD (a partial
  UTF-8 byte) keys on its raw vocabulary string. The number of ids must equal ``engram_compressed_vocab_size``.
* **Multipliers.** Per Engram layer ``l``: ``max_ngram_size`` odd int64 multipliers ``2 u + 1``, with ``u``
  drawn by ``numpy.random.default_rng(10007 * l).integers(0, bound)`` and ``bound = (2^63 - 1) // V // 2``
  (``V`` the compressed vocabulary size), so that ``id * multiplier`` never overflows.
* **Primes.** For each Engram layer, each n-gram size ``2 .. max_ngram_size`` and each of ``engram_n_heads``
  heads, the smallest prime above the previous one (restarting from ``engram_vocab_size - 1`` for every n-gram
  size) that no earlier (layer, size, head) took. A layer's table is the concatenation of those prime-sized
  ranges: its rows number the sum of its primes.
* **Hashes.** At slot ``t``, the token ``t - s`` for lookback ``s = 0 .. max_ngram_size - 1`` (the pad
  token's compressed id before slot 0) times the multiplier of ``s``; the running XOR over ``s = 0 .. k - 1``
  is the ``k``-gram's hash, taken modulo each head's prime and offset to its range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from phaselens.errors import CheckpointError, InputError, UnsupportedModelError

ENGRAM_RNG_STRIDE = 10007  # the per-layer seed is 10007 * layer id


def engram_primes(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """The bucket moduli ``[layer][n-gram size - 2][head]``, drawn in order and never reused."""
    from sympy import nextprime  # a dependency of torch; imported here as it costs 0.2 s

    seen: set[int] = set()
    out: list[list[list[int]]] = []
    for _ in range(n_layers):
        layer = []
        for _ in range(max_ngram - 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current = nextprime(current)
                while current in seen:
                    current = nextprime(current)
                seen.add(current)
                heads.append(current)
            layer.append(heads)
        out.append(layer)
    return out


def hash_multipliers(layer_ids: Sequence[int], max_ngram: int, compressed_vocab: int) -> Tensor:
    """``[n_engram_layers, max_ngram]`` odd int64 multipliers (one per layer and lookback)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(ENGRAM_RNG_STRIDE * int(layer)).integers(0, bound, size=max_ngram, dtype=np.int64)
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


def _normalizer():
    from tokenizers import Regex, normalizers

    keep = "\ue000"  # private use: a whitespace-only token survives Strip() as one space
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(), normalizers.Replace(keep, " "),
    ])


def compressed_token_map(tokenizer_json: str | Path) -> tuple[Tensor, int]:
    """``(lookup [n_tokens] int64, size)``: each token id's compressed id, and how many there are.

    ``n_tokens`` counts the tokenizer's vocabulary with its added tokens, as ``len(tokenizer)`` in transformers.
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # tokenizers raises plain Exceptions on a damaged file
        raise CheckpointError(f"{tokenizer_json} is not a tokenizer.json the tokenizers library can read: {exc}") from None
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    norm = _normalizer()
    keys: dict[str, int] = {}
    lookup = np.empty(n, dtype=np.int64)
    for i, text in enumerate(texts):  # string normalization: one token at a time by nature
        key = (tok.id_to_token(i) if "\ufffd" in text else norm.normalize_str(text)) or text
        lookup[i] = keys.setdefault(key, len(keys))
    return torch.from_numpy(lookup), len(keys)


@dataclass(frozen=True)
class EngramLayout:
    """Where each Engram layer's hashes land: primes ``[layer][size][head]`` and the table sizes."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def n_cols(self) -> int:
        """Rows looked up per token and layer: ``(max_ngram - 1) * n_heads``."""
        return (self.max_ngram - 1) * self.n_heads

    @classmethod
    def from_config(cls, cfg) -> EngramLayout:
        """Validate a :class:`~phaselens.models.deepseek_v41.V41Config`'s Engram fields and lay out the tables."""
        ids = tuple(cfg.engram_layer_ids)
        problems = []
        if sorted(set(ids)) != list(ids) or any(not 0 <= i < cfg.num_hidden_layers for i in ids):
            problems.append(f"engram_layer_ids {list(ids)} must be increasing backbone layers")
        if len(cfg.engram_num_embeddings) != len(ids):
            problems.append(f"engram_num_embeddings has {len(cfg.engram_num_embeddings)} sizes for {len(ids)} layers")
        if cfg.engram_max_ngram_size < 2 or cfg.engram_n_heads < 1 or cfg.engram_vocab_size < 2:
            problems.append("engram_max_ngram_size >= 2, engram_n_heads >= 1 and engram_vocab_size >= 2 are needed")
        if cfg.engram_head_dim < 32 or cfg.engram_head_dim % 32:
            problems.append(f"engram_head_dim {cfg.engram_head_dim} must be a multiple of 32 (one scale per 32 values)")
        if cfg.engram_compressed_vocab_size < 1:
            problems.append("engram_compressed_vocab_size is missing")
        if problems:
            raise UnsupportedModelError("the Engram config is unusable: " + "; ".join(problems) + ".")
        primes = engram_primes(len(ids), cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
        for layer, rows, p in zip(ids, cfg.engram_num_embeddings, primes):
            need = sum(map(sum, p))
            if need > rows:  # more buckets than rows: hashes would address rows the table does not have
                raise CheckpointError(
                    f"Engram layer {layer}: its hash buckets need {need} table rows but engram_num_embeddings "
                    f"gives {rows}; config.json is inconsistent."
                )
        return cls(ids, tuple(int(r) for r in cfg.engram_num_embeddings), cfg.engram_max_ngram_size,
                   cfg.engram_n_heads, cfg.engram_head_dim, tuple(tuple(map(tuple, p)) for p in primes))


class NgramHasher(nn.Module):
    """Token ids -> table rows ``[B, n, n_engram_layers, n_cols]`` (int64) for every Engram layer at once.

    Buffers: ``token_map`` ``[n_tokens]`` (compressed ids), ``multipliers`` ``[layers, max_ngram]``, ``primes``
    ``[layers, max_ngram - 1, heads]`` and ``offsets`` ``[layers, n_cols]`` (where each bucket range starts).
    """

    def __init__(self, layout: EngramLayout, token_map: Tensor, compressed_vocab: int, pad_id: int) -> None:
        super().__init__()
        self.layout = layout
        if not 0 <= pad_id < token_map.numel():
            raise CheckpointError(f"engram pad token {pad_id} is not in the tokenizer ({token_map.numel()} tokens).")
        self.pad = int(token_map[pad_id])
        primes = torch.tensor(layout.primes, dtype=torch.int64)
        flat = primes.flatten(1)
        self.register_buffer("token_map", token_map.long(), persistent=False)
        self.register_buffer("multipliers", hash_multipliers(layout.layer_ids, layout.max_ngram, compressed_vocab),
                             persistent=False)
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", flat.cumsum(1) - flat, persistent=False)

    def compress(self, tokens: Tensor) -> Tensor:
        """Compressed ids of ``tokens`` ``[B, n]`` (an :class:`InputError` for ids the tokenizer lacks)."""
        n = self.token_map.numel()
        if int(tokens.max()) >= n:
            raise InputError(
                f"token id {int(tokens.max())} is beyond the tokenizer's {n} tokens: Engram hashes tokens through "
                "tokenizer.json, so it can only read ids the tokenizer has."
            )
        return self.token_map[tokens]

    def forward(self, ids: Tensor, history: Tensor) -> Tensor:
        """Rows for compressed ids ``ids`` ``[B, n]`` after ``history`` ``[B, h]`` (the preceding compressed ids,
        ``h = min(start, max_ngram - 1)``)."""
        N = self.layout.max_ngram
        B, n = ids.shape
        pad = ids.new_full((B, N - 1 - history.shape[1]), self.pad)
        seq = torch.cat([pad, history.to(ids.dtype), ids], dim=1)  # [B, N - 1 + n]
        lookback = seq.unfold(1, N, 1).flip(-1)  # [B, n, N]: index s is token t - s
        prod = lookback.unsqueeze(2) * self.multipliers  # [B, n, layers, N]
        rolling, hashes = prod[..., 0], []
        for k in range(1, N):  # the k+1-gram's hash extends the k-gram's: sequential by nature (N - 1 <= 3)
            rolling = rolling ^ prod[..., k]
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, k - 1])  # [B, n, layers, heads]
        return torch.cat(hashes, dim=-1) + self.offsets


def history_after(history: Tensor, ids: Tensor, keep: int) -> Tensor:
    """The last ``keep`` compressed ids after appending ``ids`` ``[B, n]`` to ``history`` ``[B, h]``."""
    seq = torch.cat([history.to(ids.dtype), ids], dim=1)
    return seq[:, max(0, seq.shape[1] - keep) :]
