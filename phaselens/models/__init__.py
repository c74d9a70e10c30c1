"""Model kinds behind the contract: phaselens' compressed transformer (``compressed``), transformers'
DeepSeek-V4 through an adapter (``deepseek_v4``), phaselens' DeepSeek-V4.1 (``deepseek_v41``), the phase
ensemble (``ensemble``), ``phaselens.load`` (``sources``) and the zoo's catalogue (``zoo``).

The compressed transformer's public names resolve on first use, so ``phaselens zoo list`` and the catalogue
do not import torch.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "phaselens.models.compressed.cache": ("CompressedKVCache",),
    "phaselens.models.compressed.compressor": ("Compressor",),
    "phaselens.models.compressed.config": ("CompressedConfig", "CompressorSpec", "RopeSpec", "YarnSpec"),
    "phaselens.models.compressed.transformer": ("CompressedTransformer",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from phaselens.models.compressed.cache import CompressedKVCache
    from phaselens.models.compressed.compressor import Compressor
    from phaselens.models.compressed.config import CompressedConfig, CompressorSpec, RopeSpec, YarnSpec
    from phaselens.models.compressed.transformer import CompressedTransformer


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'phaselens.models' has no attribute {name!r}")
    import phaselens.parallel.quiet_tqdm  # noqa: F401  (before anything imports transformers)

    value = getattr(_importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "CompressedConfig",
    "CompressedKVCache",
    "CompressedTransformer",
    "Compressor",
    "CompressorSpec",
    "RopeSpec",
    "YarnSpec",
]
