"""A tiny transformers DeepSeek-V4 whose weights transformers' finegrained-fp8 integration keeps packed, on CPU.

On CUDA, ``from_pretrained`` puts ``FP8Linear`` / ``FP8GroupedLinear`` / ``FP8Experts`` modules in place and
they multiply their packed weights with Triton or DeepGEMM kernels; on CPU transformers dequantizes instead.
:func:`packed_tiny_v4` builds the CUDA layout on the CPU: the real transformers modules (through transformers'
own quantizer, as ``from_pretrained`` does), filled with FP8 block codes and FP4 expert codes, plus a *dense
twin* holding exactly the decoded weights. :func:`cpu_kernels` stands in for the GPU kernels (decode the
packed weight, then an ordinary matmul) and :class:`Watched` records every read of a packed tensor outside
those kernels, so a test can prove that no phaselens code path reads packed weights.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.deepseek_v41 import E2M1, encode_fp4_rows, encode_fp8_blocks

BLOCK = (32, 32)
# transformers' grouped o_a_proj needs whole scale blocks per group: o_lora_rank a multiple of the block
PACKABLE = dict(head_dim=80, partial_rotary_factor=0.2, index_head_dim=32, o_lora_rank=32)


def decode_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 ``[O, I]`` times one scale per 32 x 32 block -> fp32."""
    rows, cols = torch.arange(codes.shape[0]) // 32, torch.arange(codes.shape[1]) // 32
    return codes.float() * scale.float()[rows][:, cols]


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte (low nibble first) ``[O, I/2]`` times one scale per row and 32 inputs -> fp32."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)
    mag = E2M1[codes & 7]
    value = torch.where(codes >= 8, -mag, mag)
    return value * scale.float()[..., torch.arange(value.shape[-1]) // 32]


class Watched(nn.Parameter):
    """A packed parameter that records, for every operation on it other than reading its metadata, the
    operation and the source file of the code that asked (the first frame outside torch and this helper)."""

    reads: list[tuple[str, str]] = []
    METADATA = {"__get__", "element_size", "size", "dim", "numel", "is_floating_point", "__len__", "data_ptr"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in cls.METADATA:
            frame = sys._getframe(1)
            while frame and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
                frame = frame.f_back
            cls.reads.append((name, frame.f_code.co_filename if frame else "?"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _watch(module: nn.Module, name: str, value: torch.Tensor, watch: bool = True) -> None:
    module._parameters[name] = (Watched if watch else nn.Parameter)(value, requires_grad=False)


def _dense_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        return decode_fp8(weight, scale)
    return decode_fp4(weight, scale)


@contextlib.contextmanager
def cpu_kernels() -> Iterator[dict[str, int]]:
    """Replace transformers' FP8/FP4 GPU kernels (``fp8_linear``, ``fp8_grouped_matmul``) by CPU stand-ins that
    decode the packed weight and multiply; yields call counts."""
    from transformers.integrations import finegrained_fp8 as f8

    calls = {"linear": 0, "grouped": 0}

    def linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
               allow_deepgemm=True):
        w = _dense_weight(weight, weight_scale_inv).to(input.dtype)
        calls["linear"] += 1
        return F.linear(input, w, bias)

    def grouped(input, weight, weight_scale_inv, offsets, tokens_per_expert, block_size):
        w = torch.stack([decode_fp8(weight[g], weight_scale_inv[g]) for g in range(weight.shape[0])])
        calls["grouped"] += 1
        x = input.view(weight.shape[0], -1, input.shape[-1])  # rows ordered group by group
        return torch.bmm(x, w.to(input.dtype).transpose(1, 2)).reshape(-1, w.shape[1])

    saved = f8.fp8_linear, f8.fp8_grouped_matmul
    f8.fp8_linear, f8.fp8_grouped_matmul = linear, grouped
    try:
        yield calls
    finally:
        f8.fp8_linear, f8.fp8_grouped_matmul = saved


def packed_tiny_v4(seed: int = 0, *, dtype: torch.dtype = torch.float32, pack_compressors: bool = True,
                   watch: bool = True, **overrides) -> tuple[nn.Module, nn.Module]:
    """``(dense, packed)``: a tiny random DeepSeek-V4 (in ``dtype``) and its packed twin with the same numbers.

    ``packed`` holds transformers' FP8 modules where its quantizer puts them for a V4 checkpoint (attention
    and shared-expert projections ``FP8Linear``, ``o_a_proj`` ``FP8GroupedLinear``, routed experts
    ``FP8Experts`` with FP4 codes), every packed tensor a :class:`Watched`. ``pack_compressors`` also packs the
    compressors' and indexers' ``kv_proj`` / ``gate_proj`` (the release keeps them bf16), which
    ``numerics="reference"`` recomputes in fp32. ``dense`` holds the decoded weights in ordinary modules.
    ``watch=False``: plain parameters (to move the model to a GPU).
    """
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.quantizers.auto import AutoHfQuantizer

    from tests.support.deepseek import tiny_v4_model

    dense = tiny_v4_model(seed, **{**PACKABLE, **overrides}).to(dtype)
    dense.config._experts_implementation = "eager"
    quant = FineGrainedFP8Config(weight_block_size=BLOCK, scale_fmt="ue8m0", expert_dtype="fp4")
    packed = copy.deepcopy(dense)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoHfQuantizer.from_config(quant, pre_quantized=True).preprocess_model(packed, dtype=dtype)
        if pack_compressors:
            for name, module in list(packed.named_modules()):
                if name.endswith(("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj",
                                  "indexer.gate_proj")):
                    with torch.device("meta"):
                        new = FP8Linear(module.in_features, module.out_features, block_size=BLOCK,
                                        scale_fmt="ue8m0")
                    packed.set_submodule(name, new)
    source = dict(dense.named_modules())
    n = 0
    with torch.no_grad():
        for name, module in packed.named_modules():
            if isinstance(module, FP8Linear):
                w = source[name].weight
                codes, scale = encode_fp8_blocks(w)
                module.to_empty(device="cpu")
                _watch(module, "weight", codes, watch)
                _watch(module, "weight_scale_inv", scale, watch)
                w.copy_(decode_fp8(codes, scale))
                n += 1
            elif isinstance(module, FP8Experts):
                module.to_empty(device="cpu")
                for proj in ("gate_up_proj", "down_proj"):
                    w = getattr(source[name], proj)
                    pairs = [encode_fp4_rows(w[e]) for e in range(w.shape[0])]
                    codes = torch.stack([c for c, _ in pairs])
                    scales = torch.stack([s for _, s in pairs])
                    _watch(module, proj, codes, watch)
                    _watch(module, f"{proj}_scale_inv", scales, watch)
                    w.copy_(torch.stack([decode_fp4(c, s) for c, s in pairs]))
                n += 1
    assert n, "transformers' quantizer converted nothing"
    packed.config._experts_implementation = "eager"
    return dense.eval(), packed.eval()
