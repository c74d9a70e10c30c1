"""Adapters that put external models behind :class:`phaselens.protocol.PhaseModel`.

* :mod:`phaselens.adapters.deepseek_v4`: transformers' DeepSeek-V4 (``from_hf``, ``load_hf``).

Importing this package is cheap: transformers and nnsight load only when an adapter is built or used.
"""

from __future__ import annotations

from phaselens.adapters.deepseek_v4 import (
    DeepSeekV4Adapter,
    DeepSeekV4Cfg,
    DeepSeekV4Warning,
    IndexTopKWarning,
    LayerTypesWarning,
    from_hf,
    load_hf,
)

__all__ = [
    "DeepSeekV4Adapter",
    "DeepSeekV4Cfg",
    "DeepSeekV4Warning",
    "IndexTopKWarning",
    "LayerTypesWarning",
    "from_hf",
    "load_hf",
]
