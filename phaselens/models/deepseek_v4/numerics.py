"""Make a transformers DeepSeek-V4 compute as DeepSeek's reference ``inference/model.py`` does.

Two independent settings, applied by :func:`configure` (``from_transformers(numerics=..., quantize=...)``).

``numerics="reference"`` (the default). In every dtype it follows the reference where transformers' semantics
differ: the shared expert is not clamped at ``swiglu_limit`` (transformers clamps it), and a compressed-path
YaRN RoPE whose config leaves ``attention_factor`` out gets no magnitude scale (transformers would scale
cos/sin by ``0.1 ln(factor) + 1``). In half precision it also reproduces the reference's rounding:

* the compressors' and indexers' ``kv_proj`` / ``gate_proj`` run in fp32 (the reference keeps those weights in
  fp32 and upcasts its input), so gate logits, softmax weights and pooling are fp32; the pooled rows are cast
  to the model dtype before ``kv_norm``, as the reference does;
* RoPE's cos/sin tables are fp32 (transformers rounds them to the model dtype);
* the attention core, the queries' norm, the hyper-connection mixing, the router, the experts (fp32 SwiGLU
  and sum) and the head (fp32 logits) as in :mod:`.reference_ops`;
* the indexer scores in the model dtype, as the reference's bf16 ``einsum`` does (transformers scores in fp32).

``quantize`` adds the reference's quantization steps (see :mod:`.quantization`):

* ``"published"``: what DeepSeek's published ``inference/kernel.py`` computes. Its FP8 step
  (``act_quant(..., inplace=True)`` on the non-RoPE dims of the window KV and of the compressed entries) casts
  through the input's own dtype (bf16) and so changes nothing; its FP4 step (``fp4_act_quant``) does round:
  a Hadamard rotation plus FP4 on the indexer's queries and keys (input of ``indexer.scorer``).
* ``"fp8"``: as deployed: the same FP4 indexer path, and the FP8 step rounding the non-RoPE dims of every
  layer's window KV (output of ``attn.kv_norm``) and of the compressed entries (output of
  ``compressor.kv_norm``; RoPE leaves those dims alone, so rounding before it is the same) through e4m3, as an
  FP8 KV cache stores them and as the quantization-aware training saw them.

Gradients pass straight through the rounding.

Everything works by swapping the class of the modules involved for a subclass with a different ``forward``
(weights untouched, ``isinstance`` still holds, the class name says it: e.g. ``Fp32ProjectionLinear``), and
by setting a RoPE module's attention scaling (its previous value is kept). The changes stay on the
transformers model, like ``index_topk``; :func:`configure` first undoes any earlier one, so calling
``from_transformers(model, numerics="transformers")`` restores transformers' own computation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phaselens.errors import ConfigError, InputError, UnsupportedModelError
from phaselens.models.deepseek_v4 import reference_ops as ops
from phaselens.models.deepseek_v4.config import rope_dims
from phaselens.models.deepseek_v4.geometry import LayerGeometry
from phaselens.models.deepseek_v4.packed_modules import dense_weight, weight_dtype
from phaselens.models.deepseek_v4.quantization import FP4_BLOCK, FP8_BLOCK, fp8_simulate, indexer_simulate
from phaselens.models.parts.numerics_deepseek import index_scores

Numerics = Literal["reference", "transformers"]
Quantize = Literal["fp8", "published"] | None
QUANTIZE = (None, "fp8", "published")
_BASE = "_phaselens_base"  # class attribute of a swapped class: the class it replaced
_SAVED = "_phaselens_saved"  # instance attribute: {name: value} of attributes configure changed
# instance attributes a swap may set
_STATE = ("_phaselens_cast", "_phaselens_fp8_dims", "_phaselens_dtype", "_phaselens_round", "_phaselens_model_dtype")


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
    """For ``nn.Linear``: the product in fp32 (the reference's compressor ``wkv`` / ``wgate`` and its head); a
    packed FP8 weight (transformers' ``FP8Linear``) is decoded first, never read as numbers."""

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), dense_weight(self, torch.float32), bias)


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
    """For transformers' ``DeepseekV4IndexerScorer`` (queries ``[B, S, H, c]``, compressed keys ``[B, T, c]``):
    ``_phaselens_round``: Hadamard + FP4 on both first; ``_phaselens_model_dtype``: score in their dtype as the
    reference's ``einsum`` does (``relu(q . k) * w``, ``w = weights_proj(x) * c^-1/2 * H^-1/2``, summed over
    heads, every step rounded to bf16) instead of transformers' fp32."""

    _phaselens_round: bool = False
    _phaselens_model_dtype: bool = False

    def forward(self, q: Tensor, compressed_kv: Tensor, hidden_states: Tensor) -> Tensor:
        if self._phaselens_round:
            q, compressed_kv = _round(indexer_simulate, q), _round(indexer_simulate, compressed_kv)
        if not self._phaselens_model_dtype:
            return super().forward(q, compressed_kv, hidden_states)
        weights = self.weights_proj(hidden_states) * (self.softmax_scale * self.weights_scaling)  # [B, S, H]
        return index_scores(q, compressed_kv, weights)


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


def _set(module: nn.Module, name: str, value: Any) -> None:
    """Set an attribute of ``module``, keeping its first value for :func:`restore`."""
    saved = module.__dict__.setdefault(_SAVED, {})
    saved.setdefault(name, getattr(module, name))
    setattr(module, name, value)


def restore(model: nn.Module) -> int:
    """Undo every swap and attribute change on ``model``; return how many modules were restored."""
    n = 0
    for module in model.modules():
        base = getattr(type(module), _BASE, None)
        saved = module.__dict__.pop(_SAVED, None)
        if base is not None:
            module.__class__ = base
            for key in _STATE:
                module.__dict__.pop(key, None)
        for key, value in (saved or {}).items():
            setattr(module, key, value)
        n += base is not None or saved is not None
    return n


def swapped(model: nn.Module) -> dict[str, str]:
    """``{module name: swapped class name}`` of the modules whose computation phaselens changed."""
    return {name: type(m).__name__ for name, m in model.named_modules() if hasattr(type(m), _BASE)}


def unscaled_yarn(config: Any) -> list[str]:
    """The nested ``rope_parameters`` entries that are YaRN without an ``attention_factor``: transformers then
    scales their cos/sin by ``0.1 ln(factor) + 1``, which DeepSeek's reference never does. (A flat
    ``rope_scaling``, as in the released ``config.json`` files, gets ``attention_factor`` 1.0 from transformers.)"""
    params = getattr(config, "rope_parameters", None) or {}
    return [
        kind for kind, p in params.items()
        if isinstance(p, dict) and p.get("rope_type", p.get("type")) == "yarn" and "attention_factor" not in p
    ]


# The share of DeepSeek's reference's indexer picks that the adapter also makes with a binding index_topk, in
# bf16, per numerics (and between two legitimate emulations of the reference's kernels: the floor). Measured by
# tests/reference/v4_parity.py on a tiny random V4 (index_topk 16 of 64 entries; docs/deepseek_v4.md,
# "Binding index_topk"). In fp32 the picks were identical. A run's own index_topk_fragile_picks estimates the
# disagreement on the model at hand.
PICK_AGREEMENT_BF16 = {"reference": 0.998, "transformers": 0.996, "floor": (0.997, 0.999)}


def pick_agreement(numerics: Numerics, dtype: torch.dtype) -> dict[str, Any]:
    """What ``analysis_metadata["index_topk_pick_agreement"]`` says for a model of ``dtype`` (see above)."""
    if dtype == torch.float32:
        return {"measured": 1.0, "floor": None, "where": "fp32, adapter vs DeepSeek's reference (identical picks)"}
    return {"measured": PICK_AGREEMENT_BF16[numerics], "floor": list(PICK_AGREEMENT_BF16["floor"]),
            "where": "bf16, binding index_topk, adapter vs DeepSeek's reference on a tiny random V4 "
                     "(docs/deepseek_v4.md, 'Binding index_topk'); index_topk_fragile_picks estimates it per run"}


def configure(
    model: nn.Module, geometry: list[LayerGeometry], *, numerics: Numerics, quantize: Quantize
) -> list[str]:
    """Put ``model`` (a ``DeepseekV4ForCausalLM``) in the requested state; return what now runs differently
    from transformers' own code, one line per change (empty: nothing)."""
    if numerics not in ("reference", "transformers"):
        raise InputError(f"numerics must be 'reference' or 'transformers', got {numerics!r}.")
    if quantize not in QUANTIZE:
        raise InputError(f"quantize must be None, 'fp8' or 'published', got {quantize!r}.")
    unscaled = unscaled_yarn(model.config)
    if unscaled and numerics == "transformers":
        fields = ", ".join(f'rope_parameters["{k}"]["attention_factor"]' for k in unscaled)
        raise ConfigError(
            f"{fields} is missing: for a nested YaRN entry transformers then scales cos/sin by 0.1 ln(factor) + 1 "
            "(1.277 for factor 16), which DeepSeek's reference never does (logits come out tens of percent off). "
            "Set it explicitly in the config (1.0 is the reference's), or use numerics='reference', which applies "
            "no scale."
        )
    inner = model.model
    layers = [inner.layers[g.layer].self_attn for g in geometry]
    compressors = [a.compressor for a in layers if a.compressor is not None]
    indexers = [c.indexer for c in compressors if hasattr(c, "indexer")]
    nope = _check_quantize(model, bool(indexers), quantize)
    restore(model)
    notes: list[str] = []
    if numerics == "reference":
        notes.extend(_semantics(model, unscaled))
        dtype = inner.embed_tokens.weight.dtype
        if dtype in (torch.bfloat16, torch.float16):  # fp32 and fp64 compute in their own dtype throughout
            notes.extend(_precision(model, layers, compressors, indexers, dtype))
    if quantize is not None:
        notes.extend(_quantize(layers, compressors, indexers, quantize, nope))
    return notes


def _semantics(model: nn.Module, unscaled: list[str]) -> list[str]:
    """Where the reference's computation differs from transformers' in any dtype."""
    notes = []
    rotaries = [m for m in model.modules() if isinstance(m, ops.hf_module().DeepseekV4RotaryEmbedding)]
    for kind in unscaled:
        old = float(getattr(rotaries[0], f"{kind}_attention_scaling"))
        for rotary in rotaries:
            _set(rotary, f"{kind}_attention_scaling", 1.0)
        notes.append(
            f"numerics=reference: {kind} RoPE (YaRN without attention_factor in the config) unscaled: "
            f"cos/sin x 1.0 as in the reference, not transformers' {old:.4f}"
        )
    limit = float(getattr(model.config, "swiglu_limit", 0.0) or 0.0)
    shared = [layer.mlp.shared_experts for layer in model.model.layers]
    if limit > 0:
        for module in shared:
            _swap(module, ops.ReferenceSharedExpert)
        notes.append(
            f"numerics=reference: shared experts of {len(shared)} layers not clamped at swiglu_limit {limit:g} "
            "(the reference clamps only the routed experts), SwiGLU in fp32"
        )
    return notes


def _precision(
    model: nn.Module, layers: list[nn.Module], compressors: list[nn.Module], indexers: list[nn.Module],
    dtype: torch.dtype,
) -> list[str]:
    """The reference's rounding in a half-precision model."""
    inner = model.model
    for module in compressors:
        _swap(module, ReferenceCompressor, _phaselens_dtype=weight_dtype(module.kv_proj, dtype))
    for module in [*compressors, *indexers]:
        _swap(module.kv_norm, ReferenceNorm, _phaselens_cast=weight_dtype(module.kv_proj, dtype))
        for proj in (module.kv_proj, module.gate_proj):
            _swap(proj, Fp32Projection)
    for rotary in [inner.rotary_emb, *(m.rotary_emb for m in [*compressors, *indexers])]:
        _swap(rotary, Fp32RopeTables)
    for indexer in indexers:
        _swap(indexer.scorer, ReferenceScorer, _phaselens_model_dtype=True)
    for layer in inner.layers:
        _swap(layer, ops.ReferenceDecoderLayer)
        _swap(layer.self_attn, ops.ReferenceAttention)
        _swap(layer.self_attn.q_b_norm, ops.ReferenceQueryNorm)
        _swap(layer.mlp, ops.ReferenceMoe)
        _swap(layer.mlp.gate, ops.ReferenceRouter)
        _swap(layer.mlp.experts, ops.ReferenceExperts)
        _swap(layer.mlp.shared_experts, ops.ReferenceSharedExpert)  # also without a swiglu_limit
    _swap(model.lm_head, Fp32Projection)
    name = str(dtype).removeprefix("torch.")
    return [
        f"numerics=reference: kv_proj/gate_proj, gate softmax and pooling in fp32 in {len(compressors)} "
        f"compressors and {len(indexers)} indexers (pooled rows cast to {name} before kv_norm); RoPE cos/sin "
        f"in fp32; indexer scores in {name}",
        f"numerics=reference: attention core as DeepSeek's kernel (fp32 scores and softmax, probabilities "
        f"rounded to {name}, fp32 accumulation), query norm in {name}, hyper-connection mixing in fp32 in "
        f"{len(inner.layers)} layers",
        "numerics=reference: router, expert SwiGLU and the routed + shared sum in fp32; head (lm_head) in fp32",
    ]


def _check_quantize(model: nn.Module, has_indexers: bool, quantize: str | None) -> int:
    """Refuse a ``quantize`` setting the config's sizes do not admit (before anything is changed); return the
    number of non-RoPE dims FP8 rounds (0 without FP8)."""
    if quantize is None:
        return 0
    config = model.config
    nope = 0
    if quantize == "fp8":
        d, ropes = int(config.head_dim), {rope_dims(model, "main"), rope_dims(model, "compress")}
        nope = d - max(ropes)
        if len(ropes) > 1 or nope <= 0 or nope % FP8_BLOCK:
            raise UnsupportedModelError(
                f"quantize='fp8' rounds the non-RoPE dims (head_dim {d} minus the RoPE dims, {sorted(ropes)}) in "
                f"blocks of {FP8_BLOCK}, as DeepSeek's reference does; this config's are not one positive "
                f"multiple of {FP8_BLOCK}. Use a config with head_dim - qk_rope_head_dim divisible by {FP8_BLOCK} "
                "(the released models have 512 - 64 = 448), or quantize='published' / None."
            )
    c = int(config.index_head_dim)
    if has_indexers and (c % FP4_BLOCK or c & (c - 1)):
        raise UnsupportedModelError(
            f"quantize={quantize!r} rotates the indexer's {c}-dim queries and keys by a Hadamard matrix and rounds "
            f"them in blocks of {FP4_BLOCK}: index_head_dim must be a power of two and a multiple of "
            f"{FP4_BLOCK} (the released models have 128), or pass quantize=None."
        )
    return nope


def _quantize(
    layers: list[nn.Module], compressors: list[nn.Module], indexers: list[nn.Module], quantize: str, nope: int
) -> list[str]:
    notes = []
    if quantize == "fp8":
        for module in [*(a.kv_norm for a in layers), *(m.kv_norm for m in compressors)]:
            _swap(module, ReferenceNorm, _phaselens_fp8_dims=nope)  # keeps a cast set by _precision
        notes.append(
            f"quantize=fp8: FP8 e4m3 (blocks of {FP8_BLOCK}, power-of-two scales) on the {nope} non-RoPE dims of "
            f"the window KV in {len(layers)} layers and of the compressed entries in {len(compressors)} layers "
            "(as an FP8 KV cache stores them)"
        )
    for indexer in indexers:
        _swap(indexer.scorer, ReferenceScorer, _phaselens_round=True)
    notes.append(
        f"quantize={quantize}: Hadamard rotation + FP4 e2m1 (blocks of {FP4_BLOCK}, power-of-two scales) on "
        f"the indexer queries and keys in {len(indexers)} layers"
    )
    return notes
