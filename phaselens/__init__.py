"""phaselens: phase sensitivity and phase specialization in chunk-compressed KV caches.

The public API lives here; see ``docs/api.md``.
"""

from phaselens.errors import *  # noqa: F403
from phaselens.errors import __all__ as _error_names
from phaselens.geometry import PhaseSpec
from phaselens.loading import load
from phaselens.models import (
    CompressedConfig,
    CompressedKVCache,
    CompressedTransformer,
    Compressor,
    CompressorSpec,
    RopeSpec,
    YarnSpec,
)

__version__ = "0.1.0"

__all__ = [
    "CompressedConfig",
    "CompressedKVCache",
    "CompressedTransformer",
    "Compressor",
    "CompressorSpec",
    "PhaseSpec",
    "RopeSpec",
    "YarnSpec",
    "__version__",
    "load",
    *_error_names,
]
