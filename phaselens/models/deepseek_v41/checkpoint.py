"""``load_v41``: a local DeepSeek-V4.1 checkpoint directory -> :class:`DeepSeekV41` (``phaselens.load("hf:DIR")``).

Never downloads. The model is built on the meta device, switched to the checkpoint's packed layout
(``weights="packed"``, the default: FP8 and FP4 weights stay as stored), allocated on its device(s) and filled
once from the shards, one shard at a time: peak memory is the packed model plus one shard (with
``weights="dequantized"``, the dequantized model plus one tensor).
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

from phaselens.errors import CheckpointError, InputError
from phaselens.models.deepseek_v41 import device_maps
from phaselens.models.deepseek_v41.config import V41Config
from phaselens.models.deepseek_v41.format_checks import check_formats
from phaselens.models.deepseek_v41.kernels import Kernels
from phaselens.models.deepseek_v41.layers import Quantize
from phaselens.models.deepseek_v41.model import DeepSeekV41
from phaselens.models.deepseek_v41.notices import EngramDroppedWarning
from phaselens.models.deepseek_v41.weights import (
    load_weights,
    normalize,
    pack_as_released,
    pack_from_headers,
    read_index,
    wanted,
)
from phaselens.models.numerics.sizing import addressable
from phaselens.models.parts.ckpt_shards import checkpoint_dir, shard_map
from phaselens.storage.reading import peek_json_object
from phaselens.storage.resumable import check_tensor_names, read_json

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp64": torch.float64, "float64": torch.float64, "fp16": torch.float16, "float16": torch.float16}


def check_dtype(dtype: object) -> torch.dtype:
    """``dtype`` (a torch dtype or one of :data:`_DTYPES`' names) as a floating torch dtype the model computes in."""
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise InputError(f"dtype={dtype!r} is not a dtype DeepSeek-V4.1 computes in; pass one of torch.bfloat16 (the "
                     "reference's), torch.float32, torch.float64, torch.float16, or a name "
                     f"{sorted(_DTYPES)}. Packed FP8/FP4 weights stay packed whatever the dtype.")

NO_TOKENIZER = (
    "{root} has no tokenizer.json, which Engram needs: its config lists Engram lookups before layers {layers}, "
    "and they hash n-grams of normalized tokens read from the checkpoint's tokenizer. Copy tokenizer.json from "
    "the release into {root}, or pass engram='drop' to analyse the model without Engram (an ablation, recorded "
    "in analysis_metadata)."
)


def is_v41_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` has ``model_type`` ``deepseek_v41``."""
    return peek_json_object(Path(path).expanduser() / "config.json").get("model_type") == "deepseek_v41"


def load_v41(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    quantize: Quantize = None,
    index_topk: int | str | None = None,
    analysis_stride: int | None = None,
    engram: str = "run",
    n_layers: int | None = None,
    weights: Literal["packed", "dequantized"] = "packed",
    kernels: Kernels = "auto",
    device_map: Any = None,
    max_memory: Any = None,
    chunk: int | None = None,
) -> DeepSeekV41:
    """Load the text model of a DeepSeek-V4.1 checkpoint directory.

    Args:
        path: a directory with ``config.json`` (``model_type`` ``deepseek_v41``, the text model under
            ``text_config``) and sharded safetensors.
        device: where the parameters go (ignored with ``device_map``).
        dtype: ``torch.bfloat16`` (as the reference) or ``torch.float32``: the dtype of the dense weights and
            of the computation; packed weights are dequantized to it.
        quantize: ``None``, ``"kv"`` (the reference's KV-path round trips) or ``"fp8"`` (those plus FP8
            activations into FP8/FP4 GEMMs: the reference's full numerics). Recorded in ``analysis_metadata``.
        index_topk: ``None`` (the config's), an int, or ``"all"`` (keep every visible entry, lift the
            candidate filter; recorded as a modification).
        analysis_stride: the stride that defines phases (default: the smallest ratio >= 2, i.e. 2).
        engram: ``"run"`` (default) computes the Engram lookups of ``engram_layer_ids`` as the reference does;
            it needs the checkpoint's ``tokenizer.json`` (a :class:`CheckpointError` names the fix when it is
            missing). ``"drop"`` loads the model without them: an explicit ablation (warned, recorded).
        n_layers: load only the first ``n_layers`` backbone layers, the head reading the last of them (a
            truncated model, recorded as a modification): for parity checks against the reference truncated
            the same way, and for exploring early layers with less memory.
        weights: ``"packed"`` keeps FP8 and FP4 weights as stored (about a quarter of the dequantized size for
            the FP4 experts) and dequantizes them inside the forward, per layer and per selected expert;
            ``"dequantized"`` dequantizes everything at load. Both give the same numbers.
        kernels: ``"auto"`` multiplies packed weights with transformers' finegrained-fp8 kernels where they
            apply (CUDA, ``quantize="fp8"``, bf16), else dequantizes; ``"torch"`` always dequantizes (see
            :mod:`~phaselens.models.deepseek_v41.kernels`).
        device_map: spread the model over devices, with transformers/accelerate conventions: ``"auto"``,
            ``"balanced"``, ``"sequential"``, a dict ``{module name: device}`` (e.g.
            :func:`phaselens.parallel.replicas.replica_device_map`) or one device (see
            :mod:`~phaselens.models.deepseek_v41.device_maps`). Every map keeps Engram's tables (98 GB each at
            the released size) in host memory and sends each lookup's rows to its layer's GPU, unless it names
            a table (``"blocks.1.engram.embed": 0``); ``device=`` puts everything on one device.
        max_memory: the per-device budget of ``device_map="auto"``, e.g. ``{0: "70GiB", "cpu": "100GiB"}``.
        chunk: prefill in pieces of this many tokens (hooks see the query piece only); what long contexts
            need (``phaselens plan`` says which chunk fits).

    Example:
        >>> model = phaselens.load("hf:/data/DeepSeek-V4.1-Flash", device="cuda")  # doctest: +SKIP
    """
    root = checkpoint_dir(path)
    model, index = _build(root, dtype=dtype, quantize=quantize, index_topk=index_topk,
                          analysis_stride=analysis_stride, engram=engram, n_layers=n_layers, weights=weights,
                          kernels=kernels, chunk=chunk, need_weights=True)
    keep = {"skip_engram": engram == "drop", "n_layers": model.config.num_hidden_layers}
    if device_map is None:
        model.to_empty(device=device)
    else:
        placed = device_maps.resolve(model, device_map, max_memory=max_memory)
        device_maps.materialize(model, placed)
    _restore_buffers(model)  # non-persistent buffers come back uninitialised from the meta device
    load_weights(model, root, index=index, **keep)
    if device_map is not None:
        device_maps.dispatch(model, placed)
    model.set_engram_tokenizer(root / "tokenizer.json")
    model.checkpoint_dir = root  # where model.tokenizer is found (never downloaded)
    return model.eval()


def meta_v41(path: str | os.PathLike, *, dtype: torch.dtype | str = torch.bfloat16,
             weights: Literal["packed", "dequantized"] = "packed", engram: str = "run",
             n_layers: int | None = None, **model_kw: Any) -> DeepSeekV41:
    """The model of the checkpoint directory ``path`` on the meta device (shapes and dtypes, no memory): what
    :func:`phaselens.parallel.replicas.replica_device_map` and ``phaselens plan`` need before loading.

    ``path`` may hold ``config.json`` alone: packed weights then take the release's formats
    (:func:`~phaselens.models.deepseek_v41.weights.pack_as_released`); with shards, their headers decide.
    """
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise CheckpointError(f"no config.json in {root}; pass a DeepSeek-V4.1 checkpoint directory.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EngramDroppedWarning)
        model, _ = _build(root, dtype=dtype, weights=weights, engram=engram, n_layers=n_layers,
                          need_weights=False, **model_kw)
    return model


def _build(root: Path, *, dtype: torch.dtype | str, weights: str, engram: str, n_layers: int | None,
           need_weights: bool, quantize: Quantize = None, index_topk: int | str | None = None,
           analysis_stride: int | None = None, kernels: Kernels = "auto",
           chunk: int | None = None) -> tuple[DeepSeekV41, dict[str, Any] | None]:
    """The model on the meta device, in its packed layout when ``weights="packed"``, and the checkpoint's
    header index (``None`` without shards, unless ``need_weights``)."""
    dtype = check_dtype(dtype)
    for arg, value, known in (("engram", engram, ("run", "drop")), ("weights", weights, ("packed", "dequantized")),
                              ("kernels", kernels, ("auto", "torch"))):
        if value not in known:
            raise InputError(f"{arg} must be {known[0]!r} or {known[1]!r}, got {value!r}.")
    raw = read_json(root / "config.json", fix="restore config.json from the checkpoint's source.")
    digest = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()
    # the config's hash: two analyses of differently edited configs never pass for the same model
    metadata: dict[str, Any] = {"checkpoint": str(root), "config_sha256": digest, "engram": "absent",
                                "modifications": []}
    if n_layers is not None:
        raw = truncate_config(raw, n_layers)
        metadata.update(model_modified=True, modifications=[f"truncated to the first {n_layers} layers"])
    config = V41Config.from_dict(raw, name=root.name)
    layers = list(config.engram_layer_ids)
    if layers and engram == "run":
        if need_weights and not (root / "tokenizer.json").is_file():
            raise CheckpointError(NO_TOKENIZER.format(root=root, layers=layers))
        metadata["engram"] = "applied"
    elif layers:
        warnings.warn(EngramDroppedWarning(
            f"Engram lookups at layers {layers} were dropped: results describe the model without them."), stacklevel=3)
        metadata.update(engram="dropped", model_modified=True,
                        modifications=[*metadata["modifications"], f"Engram dropped at layers {layers}"])
    metadata["weights"] = weights
    with torch.device("meta"), addressable(str(root / "config.json")):
        model = DeepSeekV41(config, dtype=dtype, quantize=quantize, index_topk=index_topk,
                            analysis_stride=analysis_stride, metadata=metadata, engram=engram, kernels=kernels,
                            chunk=chunk)
    keep = {"skip_engram": engram == "drop", "n_layers": config.num_hidden_layers}
    has_shards = any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").is_file()
    if has_shards or need_weights:  # names checked against the dense layout, before a byte of weights is read
        check_v41_weights(model, root, config, skip_engram=engram == "drop")
    index = read_index(root) if need_weights or has_shards else None
    if index is not None:  # every packed tensor and scale against its format, from the headers (no data read)
        check_formats(model, index, root, **keep)
    if weights == "packed":
        if index is not None:
            pack_from_headers(model, index, **keep)
        else:
            pack_as_released(model)
    return model, index


FIX = ("config.json and the weights disagree, or a shard is incomplete; restore both from the checkpoint's source "
       "(download them again).")


def check_v41_weights(model: DeepSeekV41, root: Path, config: V41Config, *, skip_engram: bool) -> None:
    """The checkpoint's tensor names (read from its index or shard headers, no data) against the model the
    config builds: first the layer roles the names imply (which layers compress, gate and index: a config
    field that disagrees is named), then every name (:func:`~phaselens.storage.resumable.check_tensor_names`).

    What the weights cannot show is not checked: a compress ratio's value above 1 (2 and 4 give the same
    tensors) and whether a layer that reuses another's KV is compressed at all (it owns no tensors of it).
    """
    present = {normalize(k) for k in shard_map(root)}
    present = {p for p in present if wanted(p, skip_engram=skip_engram, n_layers=config.num_hidden_layers)}
    present -= {p for p in present if p.endswith(".scale") and p[: -len("scale")] + "weight" in present}
    _check_roles(config, present, root)
    expected: set[str] = set()
    for key, param in model.named_parameters():
        name = "layers." + key[len("blocks."):] if key.startswith("blocks.") else key
        experts = re.match(r"^(layers\.\d+\.ffn\.experts)\.(w[123])$", name)
        if experts:
            expected |= {f"{experts[1]}.{e}.{experts[2]}.weight" for e in range(param.shape[0])}
        else:
            expected.add(name)
    expected -= {e for e in expected if e.endswith(".scale") and e[: -len("scale")] + "weight" in expected}
    check_tensor_names(dict.fromkeys(expected), dict.fromkeys(present), where=str(root), fix=FIX, shapes=False)


def _check_roles(config: V41Config, present: set[str], root: Path) -> None:
    """Which layers the weights make KV sources (a compressor), gated (``wgate``: ratio > 1) and index
    sources (an indexer's queries), against ``kv_source_layer_ids``, ``compress_ratios`` and
    ``index_source_layer_ids``."""
    found = []
    kv, idx = set(config.kv_source_layer_ids), set(config.index_source_layer_ids)
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}.attn."
        comp = any(x.startswith(p + "compressor.") for x in present)
        gate = p + "compressor.wgate.weight" in present
        query = p + "indexer.wq_b.weight" in present
        if comp != (layer in kv):
            found.append(f"layer {layer}'s weights {'hold' if comp else 'lack'} a compressor, but kv_source_layer_ids "
                         f"{'omits' if comp else 'lists'} it")
        elif comp and gate != (config.compress_ratios[layer] > 1):
            found.append(f"layer {layer}'s compressor {'has' if gate else 'has no'} gate (wgate), which means a ratio "
                         f"{'above' if gate else 'of'} 1, but compress_ratios[{layer}] is {config.compress_ratios[layer]}")
        if query != (layer in idx):
            found.append(f"layer {layer}'s weights {'hold' if query else 'lack'} an indexer, but index_source_layer_ids "
                         f"{'omits' if query else 'lists'} it")
    if found:
        raise CheckpointError(f"{root / 'config.json'} disagrees with the weights: " + "; ".join(found[:4])
                              + (f" (and {len(found) - 4} more)" if len(found) > 4 else "") + f". {FIX}")


def truncate_config(raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """``config.json`` cut to the first ``n_layers`` backbone layers (sources and Engram layers beyond dropped).

    Engram layers are hashed in increasing order, so the kept ones keep their primes and multipliers.
    """
    text = dict(raw.get("text_config") or {})
    total = int(text.get("num_hidden_layers", 0))
    if not isinstance(n_layers, int) or not 1 <= n_layers <= total:
        raise InputError(f"n_layers must lie in 1..{total}, got {n_layers!r}.")
    keep = lambda ids: [int(i) for i in ids or () if int(i) < n_layers]  # noqa: E731
    engram = [int(i) for i in text.get("engram_layer_ids") or ()]
    tables = list(text.get("engram_num_embeddings") or [])
    if len(tables) == len(engram):  # one table per kept Engram layer (a mismatch is reported by the config check)
        text["engram_num_embeddings"] = [t for i, t in zip(engram, tables) if i < n_layers]
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


def _restore_buffers(model: DeepSeekV41) -> None:
    """Recompute the RoPE frequencies (buffers are not in the checkpoint), on each layer's device."""
    from phaselens.models.deepseek_v41.attention import layer_inv_freq

    for role, block in zip(model.roles, model.blocks):
        block.attn.inv_freq = layer_inv_freq(model.config, role).to(block.attn.inv_freq.device)
