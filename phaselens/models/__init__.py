"""The hookable compressed-cache transformer, its config, compressor and cache."""

import phaselens.runtime.quiet_tqdm  # noqa: F401  (first: before anything imports transformers)
from phaselens.models.compressed.cache import CompressedKVCache
from phaselens.models.compressed.compressor import Compressor
from phaselens.models.compressed.config import CompressedConfig, CompressorSpec, RopeSpec, YarnSpec
from phaselens.models.compressed.transformer import CompressedTransformer

__all__ = [
    "CompressedConfig",
    "CompressedKVCache",
    "CompressedTransformer",
    "Compressor",
    "CompressorSpec",
    "RopeSpec",
    "YarnSpec",
]
