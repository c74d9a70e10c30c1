"""Bytes before allocation: a :class:`CompressedTransformer`'s weights from its config, a KV cache, one forward.

Each size a user gives (the config's dimensions, ``new_cache(batch_size, max_len)``, the tokens of a call) is
priced here and checked with :func:`phaselens.runtime.budget.check_allocation` before anything is allocated,
so ``d_model=10**7`` or ``new_cache(10**6)`` is a :class:`~phaselens.errors.ResourceError` naming what
fits, not a 358 GiB allocation or the OOM killer.

* weights: counted from the config, exactly as the constructors shape them (O(1) in ``n_layers``;
  ``tests/runtime/test_allocation_pricing.py`` compares the counts with built models), plus the init's two
  temporaries of the largest parameter;
* a cache: the shapes a layer's storage allocates from (:func:`layer_shapes`);
* a forward: a lower bound (one layer's attention scores and probabilities, which coexist in the softmax,
  or the logits), so a call refused here could never have run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from phaselens.runtime.budget import check_allocation, largest_fitting

if TYPE_CHECKING:  # the model and its attention are read by shape only: sizing imports neither (they import it)
    from torch import nn

    from phaselens.models.compressed.config import CompressedConfig

RESIZABLE = ("d_model", "d_vocab", "d_mlp", "n_layers")  # the sizes a refusal suggests shrinking


def _rope_pairs(cfg: CompressedConfig, rope: Any) -> int:
    return 0 if rope is None else (cfg.d_head if rope.dims is None else rope.dims) // 2


def _compressor_elements(cfg: CompressedConfig, D: int) -> tuple[int, int]:
    """``(elements, largest)`` of one layer's compressor parameters and buffers at ``d_model = D``."""
    spec = cfg.compression
    assert spec is not None and spec.window is not None
    Hkv, d, S = cfg.n_key_value_heads, cfg.d_head, spec.stride
    k = spec.window // S
    sizes: list[int] = []
    for _ in ("kv",) if spec.tied_kv else ("k", "v"):
        if spec.payload != "attention":
            groups = k if spec.overlap_split or spec.payload == "per_offset" else 1
            sizes.append(groups * (S if spec.payload == "per_offset" else 1) * D * Hkv * d)
        if spec.gate != "uniform":
            channels = Hkv * (d if spec.gate == "vector" else 1)
            groups = k if spec.overlap_split or spec.gate_params == "per_offset" else 1
            sizes.append(groups * (S if spec.gate_params == "per_offset" else 1) * D * channels)
            sizes.append(k * S * channels if spec.position_bias else 0)
        sizes.append(d if spec.norm else 0)
    rope = cfg.rope if spec.rope == "inherit" else (spec.rope if not isinstance(spec.rope, str) else None)
    sizes.append(_rope_pairs(cfg, rope))  # the inv_freq buffer
    return sum(sizes), max(sizes)


def weight_elements(cfg: CompressedConfig, **sizes: int) -> dict[str, int]:
    """Parameter and buffer elements of ``CompressedTransformer(cfg)`` by part (``embed``, ``blocks``,
    ``unembed``), plus ``largest`` (the largest single parameter); ``sizes`` override ``d_model``, ``d_vocab``,
    ``d_mlp`` or ``n_layers`` (a refusal's search for what fits)."""
    D, V, M, L = (int(sizes.get(f, getattr(cfg, f))) for f in ("d_model", "d_vocab", "d_mlp", "n_layers"))
    H, Hkv, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    if cfg.compression is None:
        n_comp = 0
    else:
        n_comp = L if cfg.compressed_layers is None else sum(1 for i in cfg.compressed_layers if i < L)
    tied = cfg.compression is not None and cfg.compression.tied_kv

    def layer(compressed: bool) -> tuple[int, int]:
        mats = [D * H * d, H * d * D, *([D * Hkv * d] * (1 if compressed and tied else 2)),
                *([D * M] * (3 if cfg.mlp == "swiglu" else 2))]
        small = 2 * D + (H if cfg.sink else 0) + (2 * d if cfg.qk_norm else 0) + (M + D if cfg.mlp_bias else 0)
        small += _rope_pairs(cfg, cfg.rope)
        comp, comp_max = _compressor_elements(cfg, D) if compressed else (0, 0)
        return sum(mats) + small + comp, max(*mats, comp_max)

    (comp, comp_max), (plain, plain_max) = layer(n_comp > 0), layer(False)
    n_plain = L - n_comp
    return {"embed": V * D, "blocks": n_comp * comp + n_plain * plain + D,  # D: the final norm
            "unembed": 0 if cfg.tie_embeddings else V * D,
            "largest": max(V * D, comp_max if n_comp else 0, plain_max if n_plain else 0)}


def weight_bytes(cfg: CompressedConfig, dtype: torch.dtype | None = None, **sizes: int) -> dict[str, int]:
    """Bytes of building ``CompressedTransformer(cfg)`` in ``dtype`` (default: torch's default dtype), by part:
    ``embed``, ``blocks``, ``unembed`` and ``init`` (the initialisation's two temporaries of the largest
    parameter: ``randn`` and its scaled copy)."""
    size = (dtype or torch.get_default_dtype()).itemsize
    e = weight_elements(cfg, **sizes)
    return {"embed": e["embed"] * size, "blocks": e["blocks"] * size, "unembed": e["unembed"] * size,
            "init": 2 * e["largest"] * size}


def check_weights(cfg: CompressedConfig) -> None:
    """Refuse a config whose weights do not fit on the default device now (nothing to price on ``meta``)."""
    device = torch.empty(0).device
    parts = weight_bytes(cfg)

    def fits(free: int) -> str:
        found = []
        for name in RESIZABLE:
            now = int(getattr(cfg, name))
            best = largest_fitting(lambda x, n=name: sum(weight_bytes(cfg, **{n: x}).values()), free, now)
            if best:
                found.append((best / now, f"{name}={best:,}"))
        found.sort(reverse=True)  # the size that needs the smallest cut first
        return (f"use {' or '.join(s for _, s in found[:2])} or smaller (the other sizes unchanged)." if found
                else "shrink every size of the config: even one layer and one token do not fit.")

    sizes = ", ".join(f"{f}={getattr(cfg, f):,}" for f in ("n_layers", "d_model", "d_mlp", "d_vocab", "n_heads"))
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    check_allocation(f"CompressedTransformer({sizes}) in {dtype}", sum(parts.values()),
                     device=device, fits=fits, parts=parts)


def layer_shapes(attn: nn.Module, batch: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor one layer of a KV cache allocates, by name (the cache allocates from it):
    raw keys/values ``[B, rows, Hkv, d]`` (every slot in a full layer, the ring of ``local_window - 1``
    otherwise), head-major entries ``[B, Hkv, max_len // S, d]`` and the poolers' open-block state."""
    cfg = attn.cfg
    Hkv, d = cfg.n_key_value_heads, cfg.d_head
    raw = (batch, max_len if attn.kind == "full" else cfg.local_window - 1, Hkv, d)
    out = {"raw_k": raw} | ({} if attn.tied else {"raw_v": raw})
    if attn.compressor is not None:
        for path, pooler in attn.compressor.poolers.items():
            # head-major [B, Hkv, E, d]: each KV head's entries are one contiguous block for attention
            out[f"entries_{path}"] = (batch, Hkv, max_len // attn.compressor.stride, d)
            names = ("cur_payload", "prev_payload", "cur_logit", "prev_logit")
            out |= {f"{n}_{path}": sh for n, sh in zip(names, pooler.state_shapes(batch)) if sh is not None}
    return out


def cache_bytes(model: nn.Module, batch: int, max_len: int) -> int:
    """Bytes a ``CompressedKVCache(model, batch, max_len)`` allocates (every layer's storage)."""
    size = model.unembed.weight.element_size()
    return size * sum(math.prod(map(int, s)) for b in model.blocks
                      for s in layer_shapes(b.attn, batch, max_len).values())


def check_cache(model: nn.Module, batch: int, max_len: int) -> None:
    """Refuse a cache of ``batch x max_len`` that does not fit where the model is, naming what does."""
    def fits(free: int) -> str:
        b = largest_fitting(lambda x: cache_bytes(model, x, max_len), free, batch)
        n = largest_fitting(lambda x: cache_bytes(model, batch, x), free, max_len)
        opts = ([f"model.new_cache(batch_size={b:,}, max_len={max_len:,})"] if b else []) + (
            [f"model.new_cache(batch_size={batch:,}, max_len={n:,})"] if n else [])
        return (f"the largest that fit: {' or '.join(opts)}." if opts else
                "not even one sequence of one token fits: free memory.")

    w = model.unembed.weight
    check_allocation(f"a KV cache of batch_size={batch:,} x max_len={max_len:,} ({str(w.dtype).removeprefix('torch.')})",
                     cache_bytes(model, batch, max_len), device=w.device, fits=fits)


def forward_lower_bound(model: nn.Module, batch: int, n: int, start: int, rows: int) -> dict[str, int]:
    """At least the bytes a forward of ``batch`` x ``n`` new tokens after ``start`` cached ones needs: the
    largest layer's attention scores and probabilities ``[batch, H, n, keys]`` (they coexist in the softmax),
    or the logits of ``rows`` rows, whichever is larger."""
    cfg, w = model.config, model.unembed.weight
    size, prob = w.element_size(), torch.promote_types(w.dtype, torch.float32).itemsize
    keys = 0
    for b in model.blocks:
        a = b.attn
        k = start + n if a.kind == "full" else cfg.local_window
        if a.compressor is not None:
            k += (start + n) // a.compressor.stride
        keys = max(keys, k + (1 if cfg.sink else 0))
    attention = batch * cfg.n_heads * n * keys * (size + prob)
    logits = batch * rows * cfg.d_vocab * size
    return {"attention": attention} if attention >= logits else {"logits": logits}


def check_forward(model: nn.Module, batch: int, n: int, start: int, rows: int) -> None:
    """Refuse a forward that cannot fit where the model is (a lower bound, so nothing runnable is refused)."""
    def need(b: int, m: int) -> int:
        return sum(forward_lower_bound(model, b, m, start, min(rows, m)).values())

    def fits(free: int) -> str:
        b = largest_fitting(lambda x: need(x, n), free, batch)
        if b:
            return f"use batches of at most {b:,} sequences."
        m = largest_fitting(lambda x: need(1, x), free, n)
        return (f"at most {m:,} tokens of one sequence fit in one call: shorten the input, or prefill a cache in "
                "smaller pieces (model.prefill(tokens, cache, chunk=...))." if m else "not even one token fits.")

    parts = forward_lower_bound(model, batch, n, start, rows)
    check_allocation(f"a forward of {batch:,} x {n:,} tokens" + (f" after {start:,} cached" if start else ""),
                     sum(parts.values()), device=model.unembed.weight.device, fits=fits, parts=parts)


__all__ = ["cache_bytes", "check_cache", "check_forward", "check_weights", "forward_lower_bound", "layer_shapes",
           "weight_bytes", "weight_elements"]
