"""``load_hf``: a local DeepSeek-V4 checkpoint directory -> adapter (``phaselens.load("hf:PATH")``).

Never downloads: ``local_files_only=True`` everywhere, and a path that is not a directory is an error.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import warnings
from typing import Any

import torch

from phaselens.errors import CheckpointError, InputError, UnsupportedModelError
from phaselens.models.deepseek_v4.adapter import DeepSeekV4Adapter
from phaselens.models.deepseek_v4.config_checks import check_v4_config
from phaselens.models.deepseek_v4.construct import from_transformers
from phaselens.models.deepseek_v4.notices import LayerTypesWarning
from phaselens.models.parts.ckpt_shards import checkpoint_dir, shard_map
from phaselens.models.parts.loading_info import check_loading_info, check_strict
from phaselens.storage.resumable import read_json, safetensors_metadata

# from_transformers's options; everything else goes to from_pretrained.
_ADAPTER_KW = ("analysis_stride", "index_topk", "backend", "chunk", "numerics", "quantize")
# from_pretrained's loading options passed on (local files only: none of them downloads)
_LOADING_KW = ("attn_implementation", "max_memory", "offload_folder", "offload_buffers", "quantization_config",
               "key_mapping", "tp_plan", "tp_size", "device_mesh", "distributed_config", "subfolder", "variant",
               "disable_mmap", "use_kernels", "kernel_config", "experts_implementation")
OPTIONS = ("device", "dtype", "device_map", "layer_types", "strict", *_ADAPTER_KW, *_LOADING_KW)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@functools.cache
def config_fields() -> frozenset[str]:
    """The fields of transformers' ``DeepseekV4Config``: what ``load_hf`` passes on as config overrides."""
    from transformers import DeepseekV4Config

    names = {*inspect.signature(DeepseekV4Config.__init__).parameters, *DeepseekV4Config.attribute_map}
    return frozenset(names - {"self", "kwargs", "transformers_version", "architectures", "dtype", "torch_dtype"})


def check_arguments(dtype: Any, kwargs: dict[str, Any], *, where: str = "load_hf") -> None:
    """Refuse, before anything is read, a keyword ``load_hf`` does not take and a dtype that is not a floating
    one (transformers' ``TypeError`` / ``ValueError`` from deep inside otherwise)."""
    extra = set(kwargs) - set(OPTIONS)
    unknown = sorted(extra - config_fields()) if extra else []  # transformers' config imported only then
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*OPTIONS, *config_fields()], n=1)
        raise InputError(
            f"{where} got the unknown keyword argument(s) {unknown}{f' (did you mean {near[0]!r}?)' if near else ''}; "
            f"a DeepSeek-V4 checkpoint accepts {', '.join(sorted(OPTIONS))}, and any DeepseekV4Config field as a "
            "config override (e.g. sliding_window, index_topk)."
        )
    if dtype is None or (isinstance(dtype, str) and (dtype == "auto" or dtype in DTYPES)):
        return
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return
    raise InputError(f"{where}: dtype={dtype!r} is not a dtype DeepSeek-V4 computes in; pass torch.bfloat16 (the "
                     f"release's), torch.float32, torch.float16, torch.float64, one of {sorted(DTYPES)}, 'auto' or "
                     "None (the checkpoint's).")


def load_hf(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    device_map: Any = None,
    layer_types: list[str] | None = None,
    strict: bool = True,
    **kwargs: Any,
) -> DeepSeekV4Adapter:
    """Load a local transformers DeepSeek-V4 checkpoint with eager attention and wrap it.

    Args:
        path: a checkpoint directory (``config.json`` + weights).
        device: where to put the model when ``device_map`` is ``None``.
        dtype: e.g. ``torch.bfloat16`` for real weights (default: the checkpoint's).
        device_map: passed to ``from_pretrained`` (``"auto"`` spreads a large model over the GPUs and CPU);
            ``device`` is then ignored.
        layer_types: the per-layer attention schedule, to override the config's. Not needed for the released
            checkpoints: their ``config.json`` carries ``compress_ratios`` (0 sliding, 4 CSA, 128 HCA per layer),
            from which transformers builds ``layer_types``. Only a config with neither falls back to
            transformers' default schedule, which matches no released model (a ``LayerTypesWarning`` says so).
        strict: refuse a checkpoint with missing, unexpected or mis-shaped tensors (a ``CheckpointError``
            naming them); ``strict=False`` loads it as transformers does (missing weights random), with a
            :class:`~phaselens.models.parts.loading_info.CheckpointMismatchWarning`.
        **kwargs: ``analysis_stride``, ``index_topk``, ``backend``, ``chunk``, ``numerics``, ``quantize`` go to
            :func:`from_transformers`; the rest to ``DeepseekV4ForCausalLM.from_pretrained`` (config overrides included).
    """
    check_arguments(dtype, kwargs)
    check_strict(strict)
    root = checkpoint_dir(path)
    if kwargs.get("attn_implementation", "eager") != "eager":
        raise UnsupportedModelError(
            f"attn_implementation={kwargs['attn_implementation']!r}: the adapter reads eager attention "
            "probabilities and transformers 5.24 runs DeepSeek-V4 only eagerly; drop the argument."
        )
    kwargs.pop("attn_implementation", None)
    adapter_kw = {k: kwargs.pop(k) for k in _ADAPTER_KW if k in kwargs}
    raw = read_json(root / "config.json", fix="restore config.json from the checkpoint's source.")
    if not raw.get("model_type"):  # a model phaselens saved, or no transformers config at all
        raise CheckpointError(
            f"{root / 'config.json'} has no model_type"
            + (f" but phaselens's format {raw.get('format')!r}: it is a model phaselens saved, not a transformers "
               f"checkpoint; load it with phaselens.load({str(root)!r}), without 'hf:'." if raw.get("format") else
               ", so it is not a transformers checkpoint; point 'hf:' at a directory save_pretrained wrote.")
        )
    if raw.get("model_type") != "deepseek_v4":
        raise UnsupportedModelError(
            f"{root} holds a {raw.get('model_type')!r} checkpoint; load_hf supports DeepSeek-V4 "
            "('deepseek_v4')."
        )
    # pickled-only checkpoints and damaged shards are refused before transformers reads anything: every shard
    # (those the index names, else every *.safetensors file) must be complete, checked from its header
    for shard in sorted(set(shard_map(root).values())):
        safetensors_metadata(shard, fix="the download is incomplete or damaged: download this shard again.")
    check_v4_config(raw, where=f"{root / 'config.json'}", overrides=kwargs)  # the config's own fields, as plan
    n_layers = raw.get("num_hidden_layers")
    given = layer_types  # the argument; the config's layer_types was checked with the other fields
    if given is not None and (
        isinstance(given, str) or not hasattr(given, "__len__") or (isinstance(n_layers, int) and len(given) != n_layers)
    ):
        raise UnsupportedModelError(
            f"layer_types= must list one attention type per layer: the config has num_hidden_layers={n_layers}, got "
            f"{len(given) if hasattr(given, '__len__') and not isinstance(given, str) else repr(given)} entries; "
            "pass a list of that length (e.g. ['sliding_attention', 'compressed_sparse_attention', ...])."
        )
    if layer_types is not None:
        kwargs["layer_types"] = list(layer_types)
    elif "layer_types" not in raw and "compress_ratios" not in raw:
        warnings.warn(
            LayerTypesWarning(
                f"{root}/config.json has neither layer_types nor compress_ratios, so transformers' default "
                "schedule is used, which matches no released DeepSeek-V4 checkpoint; pass layer_types=[...] "
                "explicitly."
            ),
            stacklevel=2,
        )
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(
        str(root),
        local_files_only=True,
        use_safetensors=True,  # never unpickle pytorch_model.bin
        attn_implementation="eager",
        dtype=dtype,
        device_map=device_map,
        output_loading_info=True,  # what it could not fill: refused below, never random-initialised
        ignore_mismatched_sizes=True,  # so phaselens, not transformers, names the mismatched tensors
        **kwargs,
    )
    check_loading_info(root, info, strict=strict, fix=(
        "config.json and the weights disagree, or a shard is missing tensors; restore both from the checkpoint's "
        "source."))
    if device_map is None:
        model = model.to(device)
    return from_transformers(model, **adapter_kw)

