"""``from_transformers``: check a transformers DeepSeek-V4 model, set its numerics, optionally widen its indexer, and wrap it."""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from phaselens.errors import InputError
from phaselens.models.deepseek_v4.adapter import Backend, DeepSeekV4Adapter
from phaselens.models.deepseek_v4.config import check_model, unwrap
from phaselens.models.deepseek_v4.geometry import LayerGeometry, resolve_analysis_stride
from phaselens.models.deepseek_v4.numerics import Numerics, Quantize, configure, pick_agreement
from phaselens.models.parts.wrappers import unbridged


def from_transformers(
    model: Any,
    *,
    analysis_stride: int | None = None,
    index_topk: int | Literal["all"] | None = None,
    backend: Backend = "torch",
    remote: bool = False,
    chunk: int | None = None,
    numerics: Numerics | None = None,
    quantize: Quantize = None,
) -> DeepSeekV4Adapter:
    """Wrap a transformers ``DeepseekV4ForCausalLM`` (eager attention) as a phaselens model.

    Args:
        model: the transformers model, or an nnsight envoy wrapping one (kept as is, for ``remote=True``).
        analysis_stride: the stride that defines phases; one of the model's compressed strides (default:
            the smallest).
        index_topk: ``"all"`` (or an int) sets every CSA indexer's ``index_topk`` so it keeps every entry
            (or that many). This changes the model being measured, and ``analysis_metadata`` says so.
        backend: ``"torch"`` (torch hooks) or ``"nnsight"`` (module-site interventions through nnsight).
        remote: run traces on NDIF (``backend="nnsight"`` only). **Untested**: no network here.
        chunk: default prefill chunk for ``adapter(tokens)``.
        numerics: ``"reference"`` (default; ``"transformers"`` with ``remote=True``) computes as DeepSeek's
            reference inference does: in any dtype the shared expert is not clamped and a compressed YaRN
            RoPE has no magnitude scale; in bf16 / fp16 also the reference's rounding (fp32 compressor pooling
            and RoPE tables, the attention kernel's fp32 softmax, fp32 router, experts and head; see
            :mod:`.numerics`). ``"transformers"`` leaves transformers' own computation.
        quantize: ``"published"`` does what DeepSeek's published ``kernel.py`` does: Hadamard + FP4 on the
            indexer's queries and keys (its FP8 step casts through bf16 and changes nothing); ``"fp8"`` adds
            FP8 e4m3 on the non-RoPE dims of the window KV and the compressed entries, as an FP8 KV cache
            stores them; ``None`` (default) neither, as transformers.

    The model is put in ``eval()`` mode. ``numerics`` and ``quantize`` change the transformers model in place
    (module classes are swapped, weights untouched; see :mod:`.numerics`) and are recorded in
    ``analysis_metadata``; a later ``from_transformers`` on the same model sets them afresh.
    """
    hf_model, envoy = unwrap(model)
    if backend not in ("torch", "nnsight"):
        raise InputError(f"backend must be 'torch' or 'nnsight', got {backend!r}.")
    if remote and backend != "nnsight":
        raise InputError("remote=True runs through NDIF, which needs backend='nnsight'.")
    if remote and (numerics == "reference" or quantize is not None):
        raise InputError(
            "numerics='reference' and quantize change the local transformers model, but with remote=True NDIF "
            "runs its own copy: pass numerics='transformers' (the default remotely) and quantize=None."
        )
    geometry = check_model(hf_model)
    stride = resolve_analysis_stride(geometry, analysis_stride)
    numerics = numerics or ("transformers" if remote else "reference")
    numerics_changes = configure(hf_model, geometry, numerics=numerics, quantize=quantize)
    changed = _set_index_topk(hf_model, geometry, index_topk) if index_topk is not None else []
    # Kept on the model, so a later adapter of the same (already changed) model still reports the change.
    modifications = [*getattr(hf_model, "_phaselens_modifications", []), *changed]
    if changed:
        hf_model._phaselens_modifications = modifications
    hf_model.eval()
    config = hf_model.config
    import transformers

    metadata: dict[str, Any] = {
        "adapter": "phaselens.models.deepseek_v4",
        "model_type": "deepseek_v4",
        "name_or_path": str(getattr(config, "_name_or_path", "") or ""),
        "transformers_version": transformers.__version__,
        "backend": backend,
        "remote": remote,
        "attn_implementation": "eager",
        "dtype": str(hf_model.get_input_embeddings().weight.dtype),
        "layer_types": list(config.layer_types),
        "compress_rates": {k: int(v) for k, v in dict(config.compress_rates).items()},
        "phase_specs": [
            None if g.spec is None else {"stride": g.spec.stride, "window": g.spec.window, "origin": 0}
            for g in geometry
        ],
        "analysis_stride": stride,
        "origin": 0,
        "index_topk": int(config.index_topk),
        "model_modified": bool(modifications),
        "modifications": modifications,
        "numerics": numerics,
        "quantize": quantize,
        "numerics_changes": numerics_changes,
        "index_topk_binding": False,
        "index_topk_fragile_picks": None,
        "index_topk_pick_agreement": pick_agreement(numerics, hf_model.get_input_embeddings().weight.dtype),
        "max_entries_seen": 0,
        "chunk": chunk,
    }
    return DeepSeekV4Adapter(
        hf_model,
        geometry,
        analysis_stride=stride,
        backend=backend,
        envoy=envoy,
        remote=remote,
        chunk=chunk,
        metadata=metadata,
    )


def adapt_object(obj: Any, module: nn.Module, how: str, *, stride: int | None = None, window: int | None = None,
                 origin: int | None = None, **options: Any) -> DeepSeekV4Adapter:
    """The registry's adapter of a DeepSeek-V4 model object (:mod:`phaselens.models.kinds`): ``module`` the
    transformers model inside ``obj`` (an nnsight envoy is kept for ``backend="nnsight"``; a model a
    TransformerLens bridge rewired is read through its original modules), ``stride=`` read as ``analysis_stride``
    (one name for one idea), ``options`` :func:`from_transformers`'s keywords."""
    if window is not None or origin is not None:
        raise InputError("window= and origin= set the geometry of a model without compression; DeepSeek-V4 takes "
                         "its geometry from its compressed layers (analysis_stride= picks the stride).")
    if stride is not None:
        given = options.get("analysis_stride")
        if given is not None and given != stride:
            raise InputError(f"stride={stride!r} and analysis_stride={given!r} name the same setting; pass one.")
        options = {**options, "analysis_stride": stride}
    if options.get("backend") == "nnsight" and how == "nnsight":
        return from_transformers(obj, **options)
    return from_transformers(unbridged(module), **options)


def _set_index_topk(model: nn.Module, geometry: list[LayerGeometry], value: int | str) -> list[str]:
    """Set every CSA indexer's ``index_topk``; return a description of the change for the metadata."""
    config = model.config
    csa = [g for g in geometry if g.kind == "csa"]
    if not csa:
        return []
    rate = csa[0].spec.stride
    if value == "all":
        new = (
            int(config.max_position_embeddings) // rate + 1
        )  # more than the entries of any admissible length
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        new = value
    else:
        raise InputError(f"index_topk must be 'all' or a positive int, got {value!r}.")
    old = int(config.index_topk)
    if new == old:
        return []
    for g in csa:
        model.model.layers[g.layer].self_attn.compressor.indexer.index_topk = new
    config.index_topk = new
    label = "all" if value == "all" else str(new)
    return [f"index_topk {old} -> {label} ({new}) in CSA layers {[g.layer for g in csa]}"]
