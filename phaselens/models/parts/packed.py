"""Weights kept in their stored FP8 / FP4 formats, and dequantizing them (DeepSeek-V4 and V4.1 store them alike).

A packed weight is two tensors, both as a checkpoint stores them:

* ``values``: ``uint8`` bytes. FP8 (E4M3) ``[..., O, I]``, one byte per value; FP4 (E2M1) ``[..., O, I/2]``,
  two values per byte, the first in the low nibble.
* ``scale``: one power-of-two (UE8M0) scale per block of ``block = (rows, cols)`` logical values, ``[...,
  ceil(O/rows), ceil(I/cols)]``, kept as its ``uint8`` bytes (a float dtype if the checkpoint stores one).

``w[i, j] = value[i, j] * scale[i // rows, j // cols]``. The layouts in use: ``("fp8", (32, 32))``
(DeepSeek-V4.1's FP8 projections; V4's checkpoints name their own block), :data:`FP4_ROWS` ``(1, 32)`` (the
routed experts of both) and :data:`FP8_ROWS` ``(1, 32)`` (V4.1's Engram tables, read with
:func:`dequantize_rows`).

Bytes, not ``float8_e4m3fn``: ``model.to(torch.float32)`` or ``model.double()`` convert every floating-point
tensor, which would turn FP8 codes into numbers without their scales; ``uint8`` tensors are left alone.

Every product is exact in bf16 and fp32 (at most 4 significant bits times a power of two), so dequantizing
inside the forward gives bit for bit the weights that dequantizing at load gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from phaselens.errors import CheckpointError
from phaselens.models.parts.formats import E2M1_VALUES


@dataclass(frozen=True)
class PackedFormat:
    """How a packed weight's bytes are read: ``kind`` ``"fp8"`` (E4M3) or ``"fp4"`` (E2M1, two per byte),
    and the ``block`` ``(rows, cols)`` of logical values one scale covers."""

    kind: Literal["fp8", "fp4"]
    block: tuple[int, int]

    def values_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Stored shape of a logical ``[rows, cols]`` weight."""
        return (rows, cols) if self.kind == "fp8" else (rows, cols // 2)

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        bo, bi = self.block
        return (-(-rows // bo), -(-cols // bi))


FP4_ROWS = PackedFormat("fp4", (1, 32))
FP8_ROWS = PackedFormat("fp8", (1, 32))

# the dtypes a checkpoint stores packed values and UE8M0 scales in
FP8_DTYPES = (torch.float8_e4m3fn,)
FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
UE8M0_DTYPES = (torch.float8_e8m0fnu,)


def stored_kind(dtype: torch.dtype) -> Literal["fp8", "fp4"] | None:
    """``"fp8"`` for ``float8_e4m3fn``, ``"fp4"`` for packed bytes (``int8`` / ``uint8`` /
    ``float4_e2m1fn_x2``), ``None`` for a dtype that holds plain numbers."""
    if dtype in FP8_DTYPES:
        return "fp8"
    if dtype in FP4_DTYPES:
        return "fp4"
    return None


def as_bytes(t: Tensor) -> Tensor:
    """A stored FP8 / FP4 value tensor or a UE8M0 scale as its ``uint8`` bytes (a view, no copy); other
    scales (float) unchanged."""
    if t.dtype in (*FP8_DTYPES, *FP4_DTYPES, *UE8M0_DTYPES) or t.element_size() == 1 and not t.is_floating_point():
        return t.view(torch.uint8)
    return t


def scale_bytes_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a stored scale is kept in (``uint8`` for UE8M0, else its own)."""
    return torch.uint8 if dtype in UE8M0_DTYPES else dtype


def scale_values(scale: Tensor) -> Tensor:
    """fp32 values of scales kept as UE8M0 bytes (or any float dtype)."""
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu).float()
    return scale.float()


_LUTS: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _fp4_lut(device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[256, 2]``: the two E2M1 values of every byte, low nibble first."""
    key = (device, dtype)
    if key not in _LUTS:
        mag = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        nib = torch.cat([mag, -mag])  # code c: sign bit 8, magnitude c & 7
        b = torch.arange(256)
        _LUTS[key] = torch.stack((nib[b & 0xF], nib[b >> 4]), dim=-1).to(device=device, dtype=dtype)
    return _LUTS[key]


def _codes(values: Tensor, kind: str, dtype: torch.dtype) -> Tensor:
    """Unscaled values ``[..., O, I]`` in ``dtype``."""
    if values.dtype != torch.uint8:
        raise CheckpointError(f"packed weights are kept as uint8 bytes, got {values.dtype}.")
    if kind == "fp8":
        return values.view(torch.float8_e4m3fn).to(dtype)
    lut = _fp4_lut(values.device, dtype)  # [256, 2]
    idx = values.reshape(-1).int()
    word = {2: torch.int32, 4: torch.int64}.get(lut.element_size())
    if word is not None:  # one gather of a byte's two values as one machine word (~15x faster than [256, 2])
        pairs = lut.view(word).view(256).index_select(0, idx).view(dtype)
    else:
        pairs = lut.index_select(0, idx)
    return pairs.view(*values.shape[:-1], 2 * values.shape[-1])


def _exact_dtype(dtype: torch.dtype) -> torch.dtype:
    # FP8/FP4 codes times a power of two are exact in bf16/fp32/fp64 (fp32's exponent range); else fp32
    return dtype if dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32


def dequantize(values: Tensor, scale: Tensor, fmt: PackedFormat, dtype: torch.dtype) -> Tensor:
    """Packed ``values`` ``[..., O, I*]`` with ``scale`` ``[..., ceil(O/rows), ceil(I/cols)]`` -> ``[..., O, I]``
    in ``dtype``. Vectorised over every leading axis (e.g. a stack of selected experts)."""
    ct = _exact_dtype(dtype)
    w = _codes(values, fmt.kind, ct)
    n_out, n_in = w.shape[-2:]
    want = fmt.scale_shape(n_out, n_in)
    if tuple(scale.shape[-2:]) != want or scale.shape[:-2] != w.shape[:-2]:
        raise CheckpointError(
            f"a {fmt.kind} weight of logical shape {tuple(w.shape)} with {fmt.block[0]}x{fmt.block[1]} scale blocks "
            f"needs scales of shape {(*w.shape[:-2], *want)}, got {tuple(scale.shape)}."
        )
    s = scale_values(scale).to(ct)
    bo, bi = fmt.block
    if n_out % bo == 0 and n_in % bi == 0:  # whole blocks: broadcast, no expanded scale tensor
        blocks = w.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))  # [..., so, bo, si, bi]
        w = (blocks * s.unsqueeze(-2).unsqueeze(-1)).flatten(-2).flatten(-3, -2)
    else:
        w = w * s.repeat_interleave(bo, -2)[..., :n_out, :].repeat_interleave(bi, -1)[..., :n_in]
    return w.to(dtype)


def dequantize_rows(values: Tensor, scale: Tensor, fmt: PackedFormat, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows ``indices`` (any shape ``S``) of a packed table ``[N, I*]`` whose scales cover single rows
    (``fmt.block[0] == 1``, e.g. :data:`FP8_ROWS`) -> ``[*S, I]``: only the looked-up rows are dequantized."""
    if fmt.block[0] != 1:
        raise ValueError(f"row lookups need one scale row per table row, got blocks {fmt.block}")
    flat = indices.reshape(-1)
    rows = dequantize(values[flat].unsqueeze(-2), scale[flat].unsqueeze(-2), fmt, dtype).squeeze(-2)
    return rows.unflatten(0, tuple(indices.shape))

