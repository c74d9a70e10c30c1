"""A ``config.json``'s fields checked by type and range, one phrase per bad field: what the DeepSeek-V4 and
V4.1 loaders (and ``phaselens plan``) refuse before anything is built or priced."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from phaselens.core.checks import MAX_DIM

SCORING = ("sqrtsoftplus", "softmax", "sigmoid")  # the routers' scoring_func values DeepSeek's code computes
# of a DeepSeek quantization_config, what phaselens reads: FP8 E4M3 weights, FP4 or FP8 experts
QUANT_METHODS = ("fp8",)
FP8_FORMATS = ("e4m3",)
EXPERT_DTYPES = ("fp4", "fp8")


def is_int(v: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A finite real number, not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def field_type_problems(cfg: Mapping[str, Any], *, positive_int: tuple[str, ...] = (),
                   non_negative_int: tuple[str, ...] = (), positive_float: tuple[str, ...] = (),
                   non_negative_float: tuple[str, ...] = (), bools: tuple[str, ...] = (),
                   non_negative_int_lists: tuple[str, ...] = (), positive_int_lists: tuple[str, ...] = (),
                   prefix: str = "") -> list[str]:
    """The fields of ``cfg`` (those it has) that are not what their group says, in the groups' order;
    ``prefix`` names where they sit (``"text_config."``)."""
    rules = ((positive_int, lambda v: is_int(v) and v >= 1, "a positive integer"),
             (non_negative_int, lambda v: is_int(v) and v >= 0, "an integer >= 0"),
             (positive_float, lambda v: is_real(v) and v > 0, "a finite number > 0"),
             (non_negative_float, lambda v: is_real(v) and v >= 0, "a finite number >= 0"),
             (bools, lambda v: isinstance(v, bool), "true or false"),
             (non_negative_int_lists, lambda v: isinstance(v, list) and all(is_int(x) and x >= 0 for x in v),
              "a list of integers >= 0"),
             (positive_int_lists, lambda v: isinstance(v, list) and all(is_int(x) and x >= 1 for x in v),
              "a list of positive integers"))
    return [f"{prefix}{k} must be {what}, got {cfg[k]!r}"
            for names, ok, what in rules for k in names if k in cfg and not ok(cfg[k])]


def size_problems(cfg: Mapping[str, Any], sizes: tuple[str, ...], prefix: str = "",
                  lists: tuple[str, ...] = ()) -> list[str]:
    """The integer fields ``sizes`` (and the entries of the integer lists ``lists``) above ``MAX_DIM``: every
    dimension is bounded before anything is built or priced (a position count is priced from numbers and left
    unbounded)."""
    out = [f"{prefix}{k}={cfg[k]:,} exceeds {MAX_DIM:,} (2^31 - 1), the largest dimension phaselens builds"
           for k in sizes if k != "max_position_embeddings" and is_int(cfg.get(k)) and cfg[k] > MAX_DIM]
    for k in lists:
        values = cfg.get(k) if isinstance(cfg.get(k), list) else []
        big = [x for x in values if is_int(x) and x > MAX_DIM]
        if big:
            out.append(f"{prefix}{k} holds {big[0]:,}, more than {MAX_DIM:,} (2^31 - 1)")
    return out


def spans(layers: list[int]) -> str:
    """``[2, 3, 4, 7]`` as ``"2..4, 7"`` (layer lists in messages)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)


def format_problems(quant: Mapping[str, Any], formats: tuple[tuple[str, tuple[Any, ...], Any], ...]
                    ) -> list[str]:
    """``quantization_config``'s ``(key, known values, default)`` of ``formats`` that name a format phaselens
    does not read (never one it would plan or load as another)."""
    return [f"quantization_config.{key} must be one of {known} (what phaselens reads), got {quant.get(key)!r}"
            for key, known, default in formats if quant.get(key, default) not in known]


def quant_problems(quant: Any, scales: tuple[tuple[str, tuple[Any, ...], Any], ...], *, experts: Any,
                   experts_key: str, block_lengths: tuple[int, ...]) -> list[str]:
    """A DeepSeek ``quantization_config`` (``None``: absent): FP8 E4M3 weights with the kind's ``scales``
    formats (:func:`format_problems`), the routed experts' dtype ``experts`` (named ``experts_key`` in the
    message; checked even without a ``quantization_config``), and a ``weight_block_size`` of ``block_lengths``
    positive integers."""
    if quant is not None and not isinstance(quant, Mapping):
        return [f"quantization_config must be a JSON object or absent, got {quant!r}"]
    quant = quant or {}
    fp8 = (("quant_method", QUANT_METHODS, None), ("fmt", FP8_FORMATS, "e4m3"))
    out = format_problems(quant, (*fp8, *scales)) if quant else []
    if experts is not None and experts not in EXPERT_DTYPES:
        out.append(f"{experts_key} must be one of {EXPERT_DTYPES}, got {experts!r}")
    block = quant.get("weight_block_size", [1] * block_lengths[-1])
    if not (isinstance(block, list | tuple) and len(block) in block_lengths and all(is_int(b) and b >= 1
                                                                                  for b in block)):
        out.append(f"quantization_config.weight_block_size must be a list of two positive integers, got {block!r}")
    return out
