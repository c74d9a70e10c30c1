"""Make a transformers DeepSeek-V4 compute as DeepSeek's reference ``inference/model.py`` does.

Two independent settings, applied by :func:`configure` (``from_hf(numerics=..., quantize=...)``):

``numerics="reference"`` (the default) matters only for half-precision models; in fp32 nothing changes:

* the compressors' and indexers' ``kv_proj`` / ``gate_proj`` run in fp32 (the reference keeps those weights in
  fp32 and upcasts its input), so gate logits, softmax weights and pooling are fp32; the pooled rows are cast
  to the model dtype before ``kv_norm``, as the reference does;
* RoPE's cos/sin tables are fp32 (transformers rounds them to the model dtype; the reference multiplies by
  fp32 complex exponentials). The rotation itself was already computed in fp32.

``quantize="fp8"`` simulates the reference's quantization-aware-training steps (see :mod:`.quantization`):
FP8 on the non-RoPE dims of every layer's window KV (output of ``attn.kv_norm``) and of the compressed entries
(output of ``compressor.kv_norm``; RoPE leaves those dims alone, so rounding before it is the same), and a
Hadamard rotation plus FP4 on the indexer's queries and keys (input of ``indexer.scorer``; the rotation is
orthogonal, so only the rounding changes the scores). Gradients pass straight through the rounding.

Both work by swapping the class of the modules involved for a subclass with a different ``forward`` (weights
untouched, ``isinstance`` still holds, the class name says it: e.g. ``Fp32ProjectionLinear``). The swap stays
on the transformers model, like ``index_topk``; :func:`configure` first undoes any earlier swap, so calling
``from_hf(model, numerics="transformers")`` restores transformers' own computation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phaselens.core.errors import InputError, UnsupportedModelError
from phaselens.models.deepseek_v4.config import rope_dims
from phaselens.models.deepseek_v4.geometry import LayerGeometry
from phaselens.models.deepseek_v4.quantization import FP4_BLOCK, FP8_BLOCK, fp8_simulate, indexer_simulate

Numerics = Literal["reference", "transformers"]
Quantize = Literal["fp8"] | None
_BASE = "_phaselens_base"  # class attribute of a swapped class: the class it replaced
_STATE = ("_phaselens_cast", "_phaselens_fp8_dims", "_phaselens_dtype")  # instance attributes a swap may set


class _StraightThrough(torch.autograd.Function):
    """``fn(x)`` forward, identity backward: gradients through simulated rounding (whose own is 0)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _round(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return _StraightThrough.apply(x, fn) if x.requires_grad else fn(x)


class Fp32Projection:
    """For ``nn.Linear``: the product in fp32 (the reference's compressor ``wkv`` / ``wgate``)."""

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


class ReferenceNorm:
    """For transformers' ``DeepseekV4RMSNorm``: optionally cast the input first (pooled fp32 rows -> model dtype)
    and round the leading ``_phaselens_fp8_dims`` channels of the output through FP8."""

    _phaselens_cast: torch.dtype | None = None
    _phaselens_fp8_dims: int = 0

    def forward(self, x: Tensor) -> Tensor:
        if self._phaselens_cast is not None:
            x = x.to(self._phaselens_cast)
        out = super().forward(x)
        n = self._phaselens_fp8_dims
        if not n:
            return out
        return torch.cat([_round(fp8_simulate, out[..., :n]), out[..., n:]], dim=-1)


class ReferenceCompressor:
    """For transformers' CSA / HCA compressors: keep the rows in the model dtype when no entry completes.

    transformers builds that empty ``[B, 0, d]`` from the projections' dtype, fp32 once they run in fp32; the
    attention would then concatenate fp32 onto bf16 keys. The output and the cache's rows are cast back.
    """

    _phaselens_dtype: torch.dtype = torch.float32

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        compressed, bias = super().forward(*args, **kwargs)
        cache = args[3] if len(args) > 3 else kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            layer = args[4] if len(args) > 4 else kwargs["layer_idx"]
            rows = cache.layers[layer].compressed_kv  # {"compressor": ..., "indexer": ...}
            for name, value in rows.items():
                if value is not None and value.dtype != self._phaselens_dtype:
                    rows[name] = value.to(self._phaselens_dtype)
        return compressed.to(self._phaselens_dtype), bias


class Fp32RopeTables:
    """For transformers' ``DeepseekV4RotaryEmbedding``: cos/sin in fp32 whatever the input's dtype."""

    def forward(self, x: Tensor, position_ids: Tensor, layer_type: str | None = None) -> Any:
        return super().forward(x.float(), position_ids, layer_type=layer_type)


class ReferenceScorer:
    """For transformers' ``DeepseekV4IndexerScorer``: Hadamard + FP4 on the queries ``[B, S, H, c]`` and the
    compressed keys ``[B, T, c]`` before scoring."""

    def forward(self, q: Tensor, compressed_kv: Tensor, hidden_states: Tensor) -> Tensor:
        q, k = _round(indexer_simulate, q), _round(indexer_simulate, compressed_kv)
        return super().forward(q, k, hidden_states)


_DERIVED: dict[tuple[type, type], type] = {}


def _swap(module: nn.Module, mixin: type, **state: Any) -> None:
    base = getattr(type(module), _BASE, type(module))
    cls = _DERIVED.get((mixin, base))
    if cls is None:
        cls = type(mixin.__name__ + base.__name__, (mixin, base), {_BASE: base, "__module__": __name__})
        _DERIVED[(mixin, base)] = cls
    module.__class__ = cls
    for key, value in state.items():
        setattr(module, key, value)


def restore(model: nn.Module) -> int:
    """Undo every swap on ``model``; return how many modules were restored."""
    n = 0
    for module in model.modules():
        base = getattr(type(module), _BASE, None)
        if base is not None:
            module.__class__ = base
            for key in _STATE:
                module.__dict__.pop(key, None)
            n += 1
    return n


def swapped(model: nn.Module) -> dict[str, str]:
    """``{module name: swapped class name}`` of the modules whose computation phaselens changed."""
    return {name: type(m).__name__ for name, m in model.named_modules() if hasattr(type(m), _BASE)}


def configure(
    model: nn.Module, geometry: list[LayerGeometry], *, numerics: Numerics, quantize: Quantize
) -> list[str]:
    """Put ``model`` (a ``DeepseekV4ForCausalLM``) in the requested state; return what now runs differently
    from transformers' own code, one line per change (empty: nothing)."""
    if numerics not in ("reference", "transformers"):
        raise InputError(f"numerics must be 'reference' or 'transformers', got {numerics!r}.")
    if quantize not in (None, "fp8"):
        raise InputError(f"quantize must be None or 'fp8', got {quantize!r}.")
    restore(model)
    inner = model.model
    layers = [inner.layers[g.layer].self_attn for g in geometry]
    compressors = [a.compressor for a in layers if a.compressor is not None]
    indexers = [c.indexer for c in compressors if hasattr(c, "indexer")]
    notes: list[str] = []
    dtype = inner.embed_tokens.weight.dtype
    if numerics == "reference" and dtype != torch.float32:
        for module in compressors:
            _swap(module, ReferenceCompressor, _phaselens_dtype=module.kv_proj.weight.dtype)
        for module in [*compressors, *indexers]:
            _swap(module.kv_norm, ReferenceNorm, _phaselens_cast=module.kv_proj.weight.dtype)
            for proj in (module.kv_proj, module.gate_proj):
                _swap(proj, Fp32Projection)
        for rotary in [inner.rotary_emb, *(m.rotary_emb for m in [*compressors, *indexers])]:
            _swap(rotary, Fp32RopeTables)
        notes.append(
            f"numerics=reference: kv_proj/gate_proj, gate softmax and pooling in fp32 in {len(compressors)} "
            f"compressors and {len(indexers)} indexers (pooled rows cast to {str(dtype).removeprefix('torch.')} "
            "before kv_norm); RoPE cos/sin in fp32"
        )
    if quantize == "fp8":
        notes.extend(_quantize(model, layers, compressors, indexers))
    return notes


def _quantize(
    model: nn.Module, layers: list[nn.Module], compressors: list[nn.Module], indexers: list[nn.Module]
) -> list[str]:
    config = model.config
    d, ropes = int(config.head_dim), {rope_dims(model, "main"), rope_dims(model, "compress")}
    nope = d - max(ropes)
    if len(ropes) > 1 or nope <= 0 or nope % FP8_BLOCK:
        raise UnsupportedModelError(
            f"quantize='fp8' rounds the non-RoPE dims (head_dim {d} minus the RoPE dims, {sorted(ropes)}) in "
            f"blocks of {FP8_BLOCK}, as DeepSeek's reference does; this config's are not one positive multiple "
            f"of {FP8_BLOCK}. Use a config with head_dim - qk_rope_head_dim divisible by {FP8_BLOCK} (the "
            "released models have 512 - 64 = 448), or quantize=None."
        )
    c = int(config.index_head_dim)
    if indexers and (c % FP4_BLOCK or c & (c - 1)):
        raise UnsupportedModelError(
            f"quantize='fp8' rotates the indexer's {c}-dim queries and keys by a Hadamard matrix and rounds "
            f"them in blocks of {FP4_BLOCK}: index_head_dim must be a power of two and a multiple of "
            f"{FP4_BLOCK} (the released models have 128), or pass quantize=None."
        )
    for module in [*(a.kv_norm for a in layers), *(m.kv_norm for m in compressors)]:
        if isinstance(module, ReferenceNorm):
            module._phaselens_fp8_dims = nope
        else:
            _swap(module, ReferenceNorm, _phaselens_fp8_dims=nope)
    for indexer in indexers:
        _swap(indexer.scorer, ReferenceScorer)
    return [
        f"quantize=fp8: FP8 e4m3 (blocks of {FP8_BLOCK}, power-of-two scales) on the {nope} non-RoPE dims of "
        f"the window KV in {len(layers)} layers and of the compressed entries in {len(compressors)} layers",
        f"quantize=fp8: Hadamard rotation + FP4 e2m1 (blocks of {FP4_BLOCK}, power-of-two scales) on the "
        f"indexer queries and keys in {len(indexers)} layers",
    ]
