"""Every tensor of a V4.1 checkpoint against the format it is stored in, from the shards' headers (no data read).

:func:`check_formats` runs at load, before memory is allocated, and refuses what does not match with one
:class:`CheckpointError` naming each tensor, what it holds, what its format needs and the fix. Without it a
scale stored as ``int32`` or ``float8_e4m3fn`` loads silently and moves the tiny checkpoint's logits by 1.4 to
2.6 (they reach 4.2).

What each tensor the model reads must hold (``[O, I]``: its parameter's shape, per expert for routed experts;
``(bo, bi)``: ``quantization_config.weight_block_size``):

=====================  ===========================================  ==========================
tensor                 dtype                                        shape
=====================  ===========================================  ==========================
FP8 ``X.weight``       ``float8_e4m3fn``                            ``[O, I]``
its ``X.scale``        ``float8_e8m0fnu`` (UE8M0) or ``float32``    ``[ceil(O/bo), ceil(I/bi)]``
FP4 ``X.weight``       ``int8``, ``uint8``, ``float4_e2m1fn_x2``    ``[O, I/2]``
its ``X.scale``        ``float8_e8m0fnu`` or ``float32``            ``[O, ceil(I/32)]``
Engram table           ``float8_e4m3fn``                            ``[rows, head_dim]``
its ``.scale``         ``float8_e8m0fnu``                           ``[rows, head_dim/32]``
any other tensor       ``bfloat16``, ``float16``, ``float32``,       the parameter's
                       ``float64`` (a weight stored dequantized)
=====================  ===========================================  ==========================

A layer's routed experts are stacked: their weights share one format and their scales one dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from phaselens.errors import CheckpointError
from phaselens.models.deepseek_v41.weights import Stored, target, wanted
from phaselens.models.parts import packed
from phaselens.models.parts.dtypes import dtype_name
from phaselens.models.parts.packed import FP4_ROWS, PackedFormat, stored_kind

FP8, FP4, UE8M0 = packed.FP8_DTYPES, packed.FP4_DTYPES, packed.UE8M0_DTYPES
SCALES = (*UE8M0, torch.float32)
DENSE = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

FIX_DTYPE = ("the shard is damaged or was converted with other dtypes: download it again, or convert the release's "
             "weights again keeping their dtypes (FP8 values float8_e4m3fn, FP4 pairs int8, scales float8_e8m0fnu)")
FIX_SHAPE = "config.json and the weights disagree: restore both from the checkpoint's source (download them again)"
FIX_SCALE = ("the shard that holds {scale} lacks it: download it again (or, for a weight dequantized on purpose, "
             "store it as bf16/fp32)")
FIX_EXTRA_SCALE = ("download the shard again; if the weight was dequantized on purpose, drop {scale} from its shard "
                   "and from model.safetensors.index.json")


@dataclass(frozen=True)
class Need:
    """What the format needs of one stored tensor: ``role`` (a phrase), the ``dtypes`` allowed, the ``shape``,
    and the ``fix`` when the shape is wrong (a wrong dtype always gets :data:`FIX_DTYPE`)."""

    role: str
    dtypes: tuple[torch.dtype, ...]
    shape: tuple[int, ...]
    fix: str = FIX_SHAPE


def _block_hint(shape: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int]) -> str | None:
    """The power-of-two blocks that ``scale`` fits on a ``shape`` weight, when they differ from the config's."""
    if len(scale) != 2 or min(scale) < 1:
        return None
    fit = tuple(-(-n // s) for n, s in zip(shape, scale))
    pow2 = all(b & (b - 1) == 0 for b in fit)
    if not pow2 or fit == tuple(block) or PackedFormat("fp8", fit).scale_shape(*shape) != tuple(scale):  # type: ignore[arg-type]
        return None
    return (f"the scales fit {fit[0]}x{fit[1]} blocks, but config.json's quantization_config.weight_block_size is "
            f"{list(block)}: set it to {list(fit)} if the checkpoint was quantized so, else download the shard again")


def needs(model: nn.Module, index: dict[str, Stored], *, skip_engram: bool,
          n_layers: int | None) -> dict[str, Need]:
    """``{normalized name: Need}`` for every checkpoint tensor ``model`` (dense, before packing) reads."""
    params = dict(model.named_parameters())
    block = tuple(model.config.weight_block_size)
    out: dict[str, Need] = {}
    for name, st in index.items():
        if not wanted(name, skip_engram=skip_engram, n_layers=n_layers):
            continue
        t = target(name)
        param = params.get(t.key)
        if param is None or (t.expert is not None and not 0 <= t.expert < param.shape[0]):
            continue  # no place in the model: named by the tensor-name check
        shape = tuple(param.shape[1:] if t.expert is not None else param.shape)
        stem = name[: -len("weight")] if name.endswith(".weight") else None
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in index:
            continue  # checked with its weight
        scale = index.get(stem + "scale") if stem else None
        if param.dtype in FP8 + UE8M0:  # kept as stored (Engram's tables)
            need = Need("an Engram table (FP8, one UE8M0 scale per row and 32 values)", FP8, shape)
            if param.dtype in UE8M0:
                need = Need("an Engram table's scale", UE8M0, shape)
            elif scale is None:
                need = Need(f"an Engram table beside its scale {stem}scale", FP8, shape,
                            FIX_SCALE.format(scale=f"{stem}scale"))
            else:
                scale_param = params[f"{t.module}.scale"]
                out[stem + "scale"] = Need("the scale of an Engram table (UE8M0, one per row and 32 values)", UE8M0,
                                           tuple(scale_param.shape))
            out[name] = need
        elif scale is None:
            kind = stored_kind(st.dtype)
            if kind is not None and stem is not None:
                out[name] = Need(f"a quantized ({kind}) weight without its scale", (), shape,
                                 FIX_SCALE.format(scale=f"{stem}scale"))
            else:
                out[name] = Need("a dense tensor of the model", DENSE, shape)
        else:
            out.update(_pair(name, st, scale, shape, tuple(getattr(model.get_submodule(t.module), "fp8_block", block))))
    return out


def _pair(name: str, weight: Stored, scale: Stored, shape: tuple[int, ...],
          block: tuple[int, int]) -> dict[str, Need]:
    """The needs of a quantized weight ``[O, I]`` and its scale, by the weight's stored kind."""
    sname = name[: -len("weight")] + "scale"
    kind = stored_kind(weight.dtype)
    if kind is None:  # numbers beside a scale: neither format
        return {name: Need(f"a weight with a scale ({sname}), FP8 or packed FP4,", FP8 + FP4, shape,
                           FIX_EXTRA_SCALE.format(scale=sname))}
    if kind == "fp8":
        want = PackedFormat("fp8", block).scale_shape(*shape)
        fix = FIX_SHAPE
        if weight.shape == shape:
            fix = _block_hint(shape, scale.shape, block) or FIX_SHAPE
        return {name: Need(f"an FP8 weight {list(shape)}", FP8, shape),
                sname: Need(f"the scale of an FP8 weight {list(shape)} in {block[0]}x{block[1]} blocks", SCALES,
                            want, fix)}
    stored = FP4_ROWS.values_shape(*shape)
    return {name: Need(f"an FP4 weight {list(shape)} (two values per byte)", FP4, stored),
            sname: Need(f"the scale of an FP4 weight {list(shape)} (one per row and 32 inputs)", SCALES,
                        FP4_ROWS.scale_shape(*shape))}


def problems(index: dict[str, Stored], need: dict[str, Need]) -> list[str]:
    """One phrase per stored tensor that does not hold what it needs (tensor, holds, needs, fix)."""
    out = []
    for name, n in sorted(need.items()):
        st = index[name]
        if st.dtype in n.dtypes and st.shape == n.shape:
            continue
        holds = f"{st.name} (in {st.shard.name}) holds {dtype_name(st.dtype)} {list(st.shape)}"
        if not n.dtypes:
            out.append(f"{holds}: {n.role}. Fix: {n.fix}.")
            continue
        needed = " or ".join(dtype_name(d) for d in n.dtypes)
        fix = n.fix if st.dtype in n.dtypes else FIX_DTYPE
        out.append(f"{holds}, but {n.role} must be {needed} {list(n.shape)}. Fix: {fix}.")
    return out


def _mixed(index: dict[str, Stored], need: dict[str, Need]) -> list[str]:
    """Tensors of one stacked parameter (a layer's routed experts) stored in different formats or scale dtypes."""
    by_key: dict[str, dict[str, str]] = {}
    for name in sorted(need):
        if target(name).expert is None:
            continue
        st = index[name]
        kind = None if name.endswith(".scale") else stored_kind(st.dtype)
        key = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
        by_key.setdefault(key, {}).setdefault(kind or dtype_name(st.dtype), st.name)
    return [f"{' but '.join(f'{n} holds {form}' for form, n in seen.items())}: the routed experts' {key} are "
            f"stacked in one format. Fix: {FIX_DTYPE}." for key, seen in by_key.items() if len(seen) > 1]


def check_formats(model: nn.Module, index: dict[str, Stored], root: Path, *, skip_engram: bool,
                  n_layers: int | None) -> None:
    """Refuse the checkpoint at ``root`` when any tensor ``model`` reads does not hold what its format needs."""
    need = needs(model, index, skip_engram=skip_engram, n_layers=n_layers)
    found = problems(index, need) or _mixed(index, need)
    if found:
        more = " (the first 3)" if len(found) > 3 else ""
        raise CheckpointError(f"{len(found)} tensor(s) of {root} do not hold what their format needs{more}:\n- "
                              + "\n- ".join(found[:3]))
