"""``from_transformers`` (a model object) and ``load_causal_lm`` (a local checkpoint directory) -> adapter."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phaselens.errors import CheckpointError, InputError, UnsupportedModelError
from phaselens.models.causal_lm.adapter import CausalLMAdapter, spec_of
from phaselens.models.causal_lm.layout import TESTED_TYPES
from phaselens.models.parts.loading_info import check_loading_info, check_strict
from phaselens.models.parts.wrappers import bridged_modules, unbridged, unwrap_object

COMPRESSED_TYPES = ("deepseek_v4", "deepseek_v41")  # their own kinds read the geometry from the model


def from_transformers(model: Any, *, stride: int | None = None, window: int | None = None, origin: int = 0
                      ) -> CausalLMAdapter:
    """Wrap a transformers causal LM (``...ForCausalLM``), an nnsight envoy of one, or a TransformerLens bridge's
    model, as a phaselens model analysed at ``stride`` (every layer full attention: the paper's control).

    Args:
        model: the model object; it is never changed (a TransformerLens-bridged model is read through a view with
            its original modules, :func:`~phaselens.models.parts.wrappers.unbridged`).
        stride, window, origin: the geometry phases are read in (:class:`~phaselens.core.geometry.PhaseSpec`).
    """
    module, how = unwrap_object(model)
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(module, nn.Module) or config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers model; phaselens adapts a transformers causal LM "
            "(phaselens.load(model, stride=4)), an nnsight envoy or a TransformerLens bridge of one."
        )
    if model_type in COMPRESSED_TYPES:
        raise UnsupportedModelError(
            f"{type(module).__name__} is a compressed model ({model_type}): its geometry comes from the model, not "
            "a stride; use phaselens.load(model) or phaselens.from_hf(model)."
        )
    spec = spec_of(stride, window, origin, type(module).__name__)
    view = unbridged(module)
    import transformers

    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    metadata: dict[str, Any] = {
        "adapter": "phaselens.models.causal_lm",
        "model_type": model_type,
        "architecture": type(module).__name__,
        "name_or_path": str(getattr(config, "_name_or_path", "") or ""),
        "transformers_version": transformers.__version__,
        "attention": "full",
        "analysis_stride": spec.stride,
        "analysis_window": spec.window,
        "analysis_origin": spec.origin,
        "source": how if view is module else f"{how} (TransformerLens bridge, read through its original modules)",
        "sliding_window": sliding,
        "tested_architecture": model_type in TESTED_TYPES,
    }
    if view is not module:
        metadata["bridged_modules"] = len(bridged_modules(module))
    return CausalLMAdapter(view, spec, metadata=metadata)


def adapt_object(obj: Any, module: nn.Module, how: str, *, stride: int | None = None, window: int | None = None,
                 origin: int | None = None, **options: Any) -> CausalLMAdapter:
    """The registry's adapter of a causal-LM model object (:mod:`phaselens.models.kinds`): ``module`` the
    transformers model inside ``obj``, at ``stride`` / ``window`` / ``origin``; it takes no other option."""
    if options:
        raise InputError(f"{sorted(options)} do not apply to a {type(module).__name__}, a causal LM without "
                         "compression: it takes stride=, window= and origin= (the other options are DeepSeek-V4's).")
    return from_transformers(module, stride=stride, window=window, origin=0 if origin is None else origin)


def load_causal_lm(path: str | os.PathLike, *, device: str | torch.device = "cpu", stride: int | None = None,
                   window: int | None = None, origin: int = 0, dtype: torch.dtype | str | None = None,
                   device_map: Any = None, attn_implementation: str | None = None, strict: bool = True
                   ) -> CausalLMAdapter:
    """Load a local transformers causal-LM checkpoint (``phaselens.load("hf:DIR", stride=4)``); never downloads.

    Args:
        path: a directory with ``config.json`` and weights (``save_pretrained``'s).
        device: where to put the model when ``device_map`` is ``None``.
        stride, window, origin: the geometry (required ``stride``: the model has no compression).
        dtype: e.g. ``torch.bfloat16`` (default: the checkpoint's).
        attn_implementation: transformers' (default its own, SDPA); phaselens switches to eager attention only
            for forwards that hook ``hook_pattern``.
        strict: refuse a checkpoint whose tensors do not match the model (missing, unexpected or mis-shaped ones:
            a :class:`CheckpointError` naming them). ``strict=False`` loads it anyway, as transformers does
            (missing weights initialised at random), with a
            :class:`~phaselens.models.parts.loading_info.CheckpointMismatchWarning` naming them.
    """
    root = Path(path).expanduser()
    if not root.is_dir() or not (root / "config.json").is_file():
        raise CheckpointError(f"no transformers checkpoint at {root} (a directory with config.json and weights is "
                              "needed); phaselens never downloads: fetch it first, then phaselens.load('hf:DIR').")
    spec_of(stride, window, origin, str(root))  # before any weight is read
    check_strict(strict)
    from transformers import AutoModelForCausalLM

    # what transformers could not fill comes back, and is refused below (never random-initialised silently)
    kwargs: dict[str, Any] = {"local_files_only": True, "output_loading_info": True, "ignore_mismatched_sizes": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(str(root), **kwargs)
    except (ValueError, KeyError) as err:
        raise UnsupportedModelError(f"transformers cannot load {root} as a causal LM: {err}") from None
    check_loading_info(root, info, strict=strict, fix="config.json and the weights disagree, or a shard lacks "
                       "tensors: restore both from the checkpoint's source.")
    if device_map is None:
        hf = hf.to(device)
    return from_transformers(hf.eval(), stride=stride, window=window, origin=origin)
