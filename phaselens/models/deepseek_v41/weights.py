"""Reading a V4.1 checkpoint's sharded safetensors into :class:`DeepSeekV41`: packed as stored, or dequantized.

Checkpoint names are the reference's (``embed.weight``, ``layers.{l}.attn.wq_a.weight`` with its
``layers.{l}.attn.wq_a.scale``, ``layers.{l}.ffn.experts.{e}.w1.weight``, ...). transformers-style variants
are accepted too (a ``model.`` prefix, ``self_attn``/``mlp``, ``weight_scale_inv``, ``e_score_correction_bias``).
Draft-layer (``mtp.*``) and vision tensors are skipped: the text model does not use them.

A weight stored as FP8 (``float8_e4m3fn``) or packed FP4 bytes (``int8`` / ``uint8`` / ``float4_e2m1fn_x2``)
with a ``.scale`` is either

* **packed** (``weights="packed"``): :func:`pack_from_headers` reads only the shards' headers and switches
  the modules that can hold packed weights (:meth:`Linear.set_packed`, :meth:`RoutedExperts.set_packed`, and any
  module with a ``set_packed(fmt, scale_dtype)`` method) to the stored layout *before* memory is allocated;
  :func:`load_weights` then copies bytes, one shard at a time: peak memory is the packed model plus one
  shard's pages. Weight and scale are independent tensors here, so they may sit in different shards.
* **dequantized** (``weights="dequantized"``, and for modules that cannot hold packed weights): FP8 with the
  config's weight blocks, FP4 with one scale per row and 32 inputs, then cast to the parameter's dtype
  (exact in bf16).

Before either, :func:`~phaselens.models.deepseek_v41.format_checks.check_formats` checks every tensor's dtype and shape,
from the headers, against its format (a scale stored as ``int32`` or ``float8_e4m3fn`` is refused by name).

A module that can hold a packed weight (the layouts of :mod:`phaselens.models.parts.packed`) offers
``set_packed(fmt, scale_dtype)`` (replace its ``weight`` parameter by empty ``uint8`` values, add a ``scale``
parameter, set ``self.fmt``), ``stored`` (``"fp8"`` / ``"fp4"``: the release's format, for plans made from
``config.json`` alone: ``phaselens plan`` then counts it packed) and, for FP8 scales that are not the config's
32 x 32 blocks, ``fp8_block`` (e.g. ``(1, 32)``).

A parameter a module keeps in FP8's own dtypes (Engram's tables: ``float8_e4m3fn`` values and a
``float8_e8m0fnu`` ``.scale``) receives the stored tensors as they are. Anything else is copied and cast.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from phaselens.errors import CheckpointError
from phaselens.models.parts.ckpt_shards import FIX_SHARD, header, shard_map
from phaselens.models.parts.packed import (
    FP4_ROWS,
    PackedFormat,
    as_bytes,
    dequantize,
    scale_bytes_dtype,
    stored_kind,
)

SKIP_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")
_NATIVE = (torch.float8_e4m3fn, torch.float8_e8m0fnu)
_EXPERT = re.compile(r"^blocks\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "BF16": torch.bfloat16,
           "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
           "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
           "F8_E5M2": torch.float8_e5m2}
if hasattr(torch, "float4_e2m1fn_x2"):
    _DTYPES["F4"] = torch.float4_e2m1fn_x2


def normalize(name: str) -> str:
    """A checkpoint tensor name in the reference's spelling."""
    if name.startswith("model."):
        name = name[len("model.") :]
    parts = name.split(".")
    rename = {"self_attn": "attn", "mlp": "ffn", "weight_scale_inv": "scale", "e_score_correction_bias": "bias"}
    return ".".join(rename.get(p, p) for p in parts)


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor as its shard's header describes it (no data read)."""

    name: str  # as in the checkpoint
    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _stored(name: str, info: object, shard: Path) -> Stored:
    """One header entry, checked: a known dtype and a shape of non-negative ints."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{name} in {shard.name} has header entry {info!r}, not an object; {FIX_SHARD}.")
    dtype = _DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CheckpointError(f"{name} in {shard.name} has dtype {info.get('dtype')!r}, which phaselens cannot "
                              f"read (known: {sorted(_DTYPES)}); {FIX_SHARD}.")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise CheckpointError(f"{name} in {shard.name} has shape {shape!r}, not a list of sizes; {FIX_SHARD}.")
    if info["dtype"] == "F4":  # the header counts 4-bit values; torch's float4_e2m1fn_x2 holds two per element
        if not shape or shape[-1] % 2:
            raise CheckpointError(f"{name} in {shard.name} holds F4 {shape}: an odd count of 4-bit values cannot be "
                                  f"stored in bytes; {FIX_SHARD}.")
        shape = [*shape[:-1], shape[-1] // 2]
    return Stored(name, shard, dtype, tuple(shape))


def read_index(root: Path) -> dict[str, Stored]:
    """``{normalized name: Stored}`` for every tensor of the checkpoint, from the shards' headers only."""
    files = shard_map(root)
    out: dict[str, Stored] = {}
    for shard in sorted(set(files.values())):
        for name, info in header(shard).items():
            if name == "__metadata__" or files.get(name) != shard:
                continue
            out[normalize(name)] = _stored(name, info, shard)
    missing = sorted(set(files) - {s.name for s in out.values()})
    if missing:
        raise CheckpointError(f"{missing[:3]} are named in model.safetensors.index.json but missing from their "
                              "shards; download those shards again.")
    return out


# ---- where each checkpoint tensor goes ---------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """The destination of one checkpoint tensor: parameter ``key`` of module ``module`` (``expert``: the row of a
    stacked expert parameter)."""

    module: str
    attr: str
    expert: int | None = None

    @property
    def key(self) -> str:
        return f"{self.module}.{self.attr}" if self.module else self.attr


def target(name: str) -> Target:
    """Checkpoint name (normalized) -> where it goes in the model."""
    mapped = "blocks." + name[len("layers.") :] if name.startswith("layers.") else name
    expert = _EXPERT.match(mapped)
    if expert:
        layer, e, w, kind = expert.groups()
        return Target(f"blocks.{layer}.ffn.experts", w if kind == "weight" else f"{w}_scale", int(e))
    module, _, attr = mapped.rpartition(".")
    return Target(module, attr)


def wanted(name: str, *, skip_engram: bool, n_layers: int | None) -> bool:
    """Whether the text model (as loaded) reads checkpoint tensor ``name`` (normalized)."""
    if name.startswith(SKIP_PREFIXES) or (skip_engram and ".engram." in name):
        return False
    layer = re.match(r"^layers\.(\d+)\.", name)
    return not (layer and n_layers is not None and int(layer[1]) >= n_layers)


def _pairs(index: dict[str, Stored], **keep: object) -> Iterator[tuple[str, Stored, Stored]]:
    """``(weight name, weight, scale)`` of every quantized weight the model reads."""
    for name, st in index.items():
        if name.endswith(".weight") and wanted(name, **keep) and stored_kind(st.dtype):  # type: ignore[arg-type]
            scale = index.get(name[: -len("weight")] + "scale")
            if scale is not None:
                yield name, st, scale


def pack_from_headers(model: nn.Module, index: dict[str, Stored], *, skip_engram: bool,
                      n_layers: int | None) -> int:
    """Switch every module that holds a quantized checkpoint weight, and can, to the stored layout (on the
    meta device, before allocation). Returns the number of modules packed."""
    block = tuple(model.config.weight_block_size)
    seen: dict[str, PackedFormat] = {}
    for name, st, scale in _pairs(index, skip_engram=skip_engram, n_layers=n_layers):
        t = target(name)
        try:
            module = model.get_submodule(t.module)
        except AttributeError:
            continue  # reported as unused by load_weights
        if not hasattr(module, "set_packed"):
            continue
        kind = stored_kind(st.dtype)
        fmt = FP4_ROWS if kind == "fp4" else PackedFormat("fp8", getattr(module, "fp8_block", block))
        if t.module in seen:
            if seen[t.module] != fmt:
                raise CheckpointError(f"{name} is stored as {kind} but other weights of {t.module} are not; "
                                      f"the checkpoint mixes formats within one module: {FIX_SHARD}.")
            continue
        module.set_packed(fmt, scale_bytes_dtype(scale.dtype))
        seen[t.module] = fmt
    return len(seen)


# ---- filling ---------------------------------------------------------------------------------------------
def load_weights(model: nn.Module, root: Path, *, skip_engram: bool, n_layers: int | None = None,
                 index: dict[str, Stored] | None = None) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``root``, one shard at a time (raises on
    missing, extra or misshapen tensors). Modules already switched by :func:`pack_from_headers` receive the
    stored bytes; the others receive dequantized values.

    ``n_layers``: tensors of backbone layers at or beyond it are skipped (a truncated model).
    """
    from safetensors import safe_open

    index = read_index(root) if index is None else index
    block = tuple(model.config.weight_block_size)
    params = dict(model.named_parameters())
    keep = {"skip_engram": skip_engram, "n_layers": n_layers}
    filled: set[str] = set()
    unused: list[str] = []
    by_shard: dict[Path, list[str]] = {}
    for name, st in sorted(index.items()):
        if not wanted(name, **keep):  # type: ignore[arg-type]
            continue
        t = target(name)
        if t.key not in params:
            if not (name.endswith(".scale") and name[: -len("scale")] + "weight" in index):
                unused.append(name)
            continue
        by_shard.setdefault(st.shard, []).append(name)
    with torch.no_grad(), ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(stored: Stored) -> Tensor:  # a scale from any shard (dequantizing at load), handles kept open
            if stored.shard not in handles:
                handles[stored.shard] = stack.enter_context(safe_open(str(stored.shard), framework="pt"))
            return handles[stored.shard].get_tensor(stored.name)

        for shard, names in sorted(by_shard.items()):
            with safe_open(str(shard), framework="pt") as f:
                for name in names:
                    t = target(name)
                    fmt = getattr(model.get_submodule(t.module), "fmt", None)
                    param = params[t.key]
                    native = param.dtype in _NATIVE  # kept as stored in FP8's own dtypes (Engram's tables)
                    if name.endswith(".scale") and fmt is None and not native:
                        continue  # dequantized with its weight
                    value = f.get_tensor(index[name].name)
                    if fmt is not None:
                        value = as_bytes(value)
                        if value.dtype != param.dtype:  # bytes copied as they are: no cast may change them
                            raise CheckpointError(f"{name} holds {value.dtype} but its module keeps {param.dtype}; "
                                                  f"{FIX_SHARD}.")
                    elif native:
                        if value.dtype != param.dtype:
                            raise CheckpointError(f"{name} must be stored as {param.dtype} (an Engram table: FP8 "
                                                  f"values, UE8M0 scales), got {value.dtype}; {FIX_SHARD}.")
                    else:
                        value = _dense(name, value, index, block, read)
                    dest = param[t.expert] if t.expert is not None else param
                    if tuple(value.shape) != tuple(dest.shape):
                        raise CheckpointError(
                            f"{name} has shape {tuple(value.shape)} but the config implies {tuple(dest.shape)}; "
                            "config.json and the weights disagree: restore both from the checkpoint's source."
                        )
                    dest.copy_(value.to(device=dest.device, dtype=dest.dtype))
                    filled.add(f"{t.key}[{t.expert}]" if t.expert is not None else t.key)
    if unused:
        raise CheckpointError(
            f"{len(unused)} checkpoint tensors have no place in the text model, e.g. {unused[:5]}; "
            "the checkpoint does not match its config.json."
        )
    missing = [k for k in _expected(params) if k not in filled]
    if missing:
        raise CheckpointError(
            f"{len(missing)} parameters are missing from the checkpoint, e.g. {missing[:5]}; it is incomplete."
        )


def _dense(name: str, weight: Tensor, index: dict[str, Stored], block: tuple[int, int],
           read: Callable[[Stored], Tensor]) -> Tensor:
    """One checkpoint tensor with numbers in it: dequantized (fp32, or the model dtype) when it has a scale."""
    kind = stored_kind(weight.dtype)
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    if scale_name not in index:
        if kind is not None:
            raise CheckpointError(f"{name} is stored as {weight.dtype} without its scale {scale_name}; the "
                                  f"checkpoint is incomplete: {FIX_SHARD}.")
        return weight
    if kind is None:
        raise CheckpointError(f"{name} has a scale but holds {weight.dtype}, where FP8 (float8_e4m3fn) or packed "
                              f"FP4 (int8) is needed; {FIX_SHARD}.")
    scale = as_bytes(read(index[scale_name]))
    fmt = FP4_ROWS if kind == "fp4" else PackedFormat("fp8", block)
    try:
        return dequantize(as_bytes(weight), scale, fmt, torch.float32)
    except CheckpointError as err:
        raise CheckpointError(f"{name} with {scale_name}: {err} config.json and the weights disagree: restore both "
                              "from the checkpoint's source.") from None


def _expected(params: dict[str, nn.Parameter]) -> Iterator[str]:
    for key, p in params.items():
        if re.match(r"^blocks\.\d+\.ffn\.experts\.w[123](_scale)?$", key):
            yield from (f"{key}[{e}]" for e in range(p.shape[0]))
        else:
            yield key


def pack_as_released(model: nn.Module) -> int:
    """Without a checkpoint (a plan from ``config.json`` alone): switch every module to the format the release
    stores it in (``module.stored``: FP8 projections with the config's weight blocks; routed experts in FP4,
    or FP8 when ``quantization_config.expert_dtype`` says so). Returns the number of modules packed."""
    cfg = model.config
    block = tuple(cfg.weight_block_size)
    quant = cfg.extra.get("quantization_config") or {}
    experts = quant.get("expert_dtype", (cfg.extra.get("text_config") or {}).get("expert_dtype", "fp4"))
    n = 0
    for module in model.modules():
        stored = getattr(module, "stored", None)
        if stored not in ("fp8", "fp4") or not hasattr(module, "set_packed"):
            continue
        if stored == "fp4" and experts != "fp4":
            stored = "fp8"
        fmt = FP4_ROWS if stored == "fp4" else PackedFormat("fp8", getattr(module, "fp8_block", block))
        module.set_packed(fmt, torch.uint8)
        n += 1
    return n
