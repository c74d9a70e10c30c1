"""The hookable compressed-cache transformer, its config, compressor and cache."""

import phaselens._quiet_tqdm  # noqa: F401  (first: before anything imports transformers)
from phaselens.models.cache import CompressedKVCache
from phaselens.models.compressor import Compressor
from phaselens.models.config import CompressedConfig, CompressorSpec, RopeSpec, YarnSpec
from phaselens.models.transformer import CompressedTransformer

__all__ = [
    "CompressedConfig",
    "CompressedKVCache",
    "CompressedTransformer",
    "Compressor",
    "CompressorSpec",
    "RopeSpec",
    "YarnSpec",
]
