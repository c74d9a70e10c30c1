"""GEMMs on packed weights: transformers' finegrained-fp8 kernels on CUDA where they apply, else dequantize.

transformers' ``fp8_linear`` (``transformers.integrations.finegrained_fp8``: Triton, or DeepGEMM where it
takes the shape) multiplies FP8 (E4M3, block scales) or packed FP4 (E2M1, per-row scales) weights directly,
quantizing its input to FP8 on the fly. That input quantization is what the reference does (``act_quant``
before every FP8/FP4 GEMM), i.e. phaselens's ``quantize="fp8"``; without it phaselens multiplies unquantized
activations, which the kernel cannot. So a kernel is used only when all hold:

* the weight lives on a CUDA device, the model runs ``quantize="fp8"`` and the activations are bf16;
* the model was loaded with ``kernels="auto"`` (``kernels="torch"`` always dequantizes);
* transformers imports the kernel (the ``kernels`` package fetches it from the Hub once, then from its
  cache). A machine without it falls back to dequantizing, with one :class:`KernelFallbackWarning`.

Everywhere else the weight is dequantized to the activations' dtype right before the GEMM
(:func:`~phaselens.models.parts.packed.dequantize`): the same numbers as dequantizing at load.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Literal

import torch
from torch import Tensor

from phaselens.models.deepseek_v41.notices import KernelFallbackWarning
from phaselens.models.parts.packed import PackedFormat

Kernels = Literal["auto", "torch"]

# which path each packed GEMM took ("transformers" / "dequantize"): read by tests and the GPU check
CALLS: Counter[str] = Counter()
_BROKEN: dict[str, str] = {}


def wants_kernel(policy: Kernels, x: Tensor, values: Tensor, activations_fp8: bool) -> bool:
    """Whether this GEMM should go to transformers' kernel (see the module docstring)."""
    return (policy == "auto" and activations_fp8 and values.is_cuda and x.dtype == torch.bfloat16
            and "all" not in _BROKEN)


def kernel_linear(x: Tensor, values: Tensor, scale: Tensor, fmt: PackedFormat) -> Tensor | None:
    """``x @ W^T`` through transformers' ``fp8_linear`` (``x`` ``[..., I]`` bf16 -> ``[..., O]`` bf16), or
    ``None`` when the kernel is unavailable (the caller dequantizes)."""
    try:
        from transformers.integrations.finegrained_fp8 import fp8_linear
    except ImportError as err:  # transformers too old
        _give_up(f"transformers has no finegrained_fp8.fp8_linear ({err})")
        return None
    weight = values.view(torch.float8_e4m3fn) if fmt.kind == "fp8" else values.view(torch.int8)
    sf = scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8 else scale
    try:
        out = fp8_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, sf, block_size=list(fmt.block))
    except (ImportError, RuntimeError, ValueError, NotImplementedError, AssertionError, TypeError) as err:
        _give_up(f"{type(err).__name__}: {err}")
        return None
    CALLS["transformers"] += 1
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _give_up(reason: str) -> None:
    if "all" not in _BROKEN:
        _BROKEN["all"] = reason
        warnings.warn(KernelFallbackWarning(
            f"transformers' finegrained-fp8 kernel cannot run here ({reason}); packed FP8/FP4 weights are "
            "dequantized inside the forward instead (same numbers as kernels='torch')."), stacklevel=3)


def kernel_status() -> dict[str, object]:
    """Which paths ran so far and why the kernel was given up (for benchmarks and the GPU check)."""
    return {"calls": dict(CALLS), "kernel_unavailable": _BROKEN.get("all")}
