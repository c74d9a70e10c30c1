"""``load_v41``: a local DeepSeek-V4.1 checkpoint directory -> :class:`DeepSeekV41` (``phaselens.load("hf:DIR")``).

Never downloads. The model is built on the meta device and each parameter is filled once from the shards,
so peak memory is about the dequantized model (2 bytes per parameter in bf16) plus one tensor.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

from phaselens.core.errors import CheckpointError, InputError, UnsupportedModelError
from phaselens.models.deepseek_v41.config import V41Config
from phaselens.models.deepseek_v41.layers import Quantize
from phaselens.models.deepseek_v41.model import DeepSeekV41
from phaselens.models.deepseek_v41.notices import EngramDroppedWarning
from phaselens.models.deepseek_v41.weights import load_weights

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp64": torch.float64, "float64": torch.float64}

ENGRAM_REASON = (
    "its config lists Engram layers {layers}: before each of them the reference adds a gated n-gram "
    "hash-table lookup to every hyper-connection stream (gate = sigmoid of a signed square root, never 0), so "
    "the text model's hidden states from layer {first} on depend on it. phaselens does not implement "
    "Engram's tokenizer-dependent n-gram hashing or its tables, and will not silently analyse a different model. "
    "Pass engram='drop' to analyse the model without Engram (recorded in analysis_metadata as a modification)."
)


def is_v41_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` has ``model_type`` ``deepseek_v41``."""
    cfg = Path(path).expanduser() / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type") == "deepseek_v41"
    except (OSError, ValueError, AttributeError):
        return False


def load_v41(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    quantize: Quantize = None,
    index_topk: int | str | None = None,
    analysis_stride: int | None = None,
    engram: Literal["refuse", "drop"] = "refuse",
    n_layers: int | None = None,
) -> DeepSeekV41:
    """Load the text model of a DeepSeek-V4.1 checkpoint directory.

    Args:
        path: a directory with ``config.json`` (``model_type`` ``deepseek_v41``, the text model under
            ``text_config``) and sharded safetensors.
        device: where the parameters go.
        dtype: ``torch.bfloat16`` (as the reference) or ``torch.float32``; quantized weights are dequantized
            to it.
        quantize: ``None``, ``"kv"`` (the reference's KV-path round trips) or ``"fp8"`` (those plus FP8
            activations into FP8/FP4 GEMMs: the reference's full numerics). Recorded in ``analysis_metadata``.
        index_topk: ``None`` (the config's), an int, or ``"all"`` (keep every visible entry, lift the
            candidate filter; recorded as a modification).
        analysis_stride: the stride that defines phases (default: the smallest ratio >= 2, i.e. 2).
        engram: ``"refuse"`` raises :class:`UnsupportedModelError` on a checkpoint with Engram layers;
            ``"drop"`` loads it without them (a different model; recorded and warned).
        n_layers: load only the first ``n_layers`` backbone layers, the head reading the last of them (a
            truncated model, recorded as a modification): for parity checks against the reference truncated
            the same way, and for exploring early layers with less memory.

    Example:
        >>> model = phaselens.load("hf:/data/DeepSeek-V4.1-Flash", device="cuda")  # doctest: +SKIP
    """
    root = Path(path).expanduser()
    if not root.is_dir() or not (root / "config.json").is_file():
        raise CheckpointError(
            f"no checkpoint at {root} (a directory with config.json and *.safetensors is needed); phaselens "
            "never downloads: fetch the weights first."
        )
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InputError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}.")
        dtype = _DTYPES[dtype]
    if engram not in ("refuse", "drop"):
        raise InputError(f"engram must be 'refuse' or 'drop', got {engram!r}.")
    try:
        raw = json.loads((root / "config.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"{root / 'config.json'} is not valid JSON: {exc}.") from None
    metadata: dict[str, Any] = {"checkpoint": str(root), "engram": "absent", "modifications": []}
    if n_layers is not None:
        raw = truncate_config(raw, n_layers)
        metadata.update(model_modified=True, modifications=[f"truncated to the first {n_layers} layers"])
    config = V41Config.from_dict(raw, name=root.name)
    if config.engram_layer_ids:
        layers = list(config.engram_layer_ids)
        if engram == "refuse":
            raise UnsupportedModelError(f"{root} cannot be loaded faithfully: " + ENGRAM_REASON.format(
                layers=layers, first=min(layers)))
        warnings.warn(EngramDroppedWarning(
            f"Engram lookups at layers {layers} were dropped: results describe the model without them."), stacklevel=2)
        metadata.update(engram="dropped", model_modified=True,
                        modifications=[*metadata["modifications"], f"Engram dropped at layers {layers}"])
    with torch.device("meta"):
        model = DeepSeekV41(config, dtype=dtype, quantize=quantize, index_topk=index_topk,
                            analysis_stride=analysis_stride, metadata=metadata)
    model.to_empty(device=device)
    _restore_buffers(model, device)  # non-persistent buffers come back uninitialised from the meta device
    load_weights(model, root, skip_engram=engram == "drop", n_layers=config.num_hidden_layers)
    return model.eval()


def truncate_config(raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """``config.json`` cut to the first ``n_layers`` backbone layers (sources and Engram layers beyond dropped)."""
    text = dict(raw.get("text_config") or {})
    total = int(text.get("num_hidden_layers", 0))
    if not isinstance(n_layers, int) or not 1 <= n_layers <= total:
        raise InputError(f"n_layers must lie in 1..{total}, got {n_layers!r}.")
    keep = lambda ids: [int(i) for i in ids or () if int(i) < n_layers]  # noqa: E731
    text.update(
        num_hidden_layers=n_layers,
        compress_ratios=list(text.get("compress_ratios", []))[:n_layers],
        kv_source_layer_ids=keep(text.get("kv_source_layer_ids")),
        index_source_layer_ids=keep(text.get("index_source_layer_ids")),
        engram_layer_ids=keep(text.get("engram_layer_ids")),
    )
    if int(text.get("candidate_source_layer_id", -1)) >= n_layers:
        text["candidate_source_layer_id"] = -1
    return {**raw, "text_config": text}


def _restore_buffers(model: DeepSeekV41, device: str | torch.device) -> None:
    """Recompute the RoPE frequencies (buffers are not in the checkpoint)."""
    from phaselens.models.deepseek_v41.layers import rope_frequencies

    c = model.config
    for role, block in zip(model.roles, model.blocks):
        if role.compressed:
            f = rope_frequencies(c.qk_rope_head_dim, c.compress_rope_theta, factor=c.rope_factor,
                                 original=c.rope_original_max_position, beta_fast=c.beta_fast, beta_slow=c.beta_slow)
        else:
            f = rope_frequencies(c.qk_rope_head_dim, c.rope_theta)
        block.attn.inv_freq = f.to(device)
