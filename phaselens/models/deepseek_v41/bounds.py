"""What the V4.1 config checks say about sizes and layer indices: every dimension bounded before anything is built
or priced (``load`` and ``phaselens plan`` alike), and layer lists written as spans (``2..39``)."""

from __future__ import annotations

from typing import Any

from phaselens.core.checks import MAX_DIM


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def size_problems(text: dict[str, Any], sizes: tuple[str, ...]) -> list[str]:
    """The integer fields ``sizes`` of ``text_config`` (and its table and ratio lists) bounded by ``MAX_DIM`` before
    anything is built or priced; a position count is priced from numbers and left unbounded."""
    sized = [k for k in sizes if k != "max_position_embeddings"]
    out = [f"text_config.{k}={text[k]:,} exceeds {MAX_DIM:,} (2^31 - 1), the largest dimension phaselens builds"
           for k in sized if _int(text.get(k)) and text[k] > MAX_DIM]
    for k in ("engram_num_embeddings", "compress_ratios"):
        big = [x for x in text.get(k) or [] if _int(x) and x > MAX_DIM] if isinstance(text.get(k), list) else []
        if big:
            out.append(f"text_config.{k} holds {big[0]:,}, more than {MAX_DIM:,} (2^31 - 1)")
    return out


def spans(layers: list[int]) -> str:
    """``[2, 3, 4, 7]`` as ``"2..4, 7"``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)
