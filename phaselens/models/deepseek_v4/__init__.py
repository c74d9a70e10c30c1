"""transformers' DeepSeek-V4 behind phaselens' :class:`~phaselens.contract.protocol.PhaseModel` protocol.

* :func:`from_transformers` wraps a loaded ``DeepseekV4ForCausalLM`` (eager attention);
* :func:`load_hf` loads a local checkpoint directory (``phaselens.load("hf:PATH")``);
* :class:`DeepSeekV4Adapter` is the result: geometry from the config, our hook names and shapes, chunked
  prefill, torch or nnsight interventions, numerics as DeepSeek's reference computes them;
* :func:`estimate_memory` sizes a run (weights, cache, attention, logits), also on a meta-device model.

See ``docs/deepseek_v4.md``.
"""

from __future__ import annotations

import phaselens.parallel.quiet_tqdm  # noqa: F401  (first: before anything imports transformers)
from phaselens.models.deepseek_v4.adapter import DeepSeekV4Adapter
from phaselens.models.deepseek_v4.checkpoint import load_hf
from phaselens.models.deepseek_v4.config import DeepSeekV4Cfg
from phaselens.models.deepseek_v4.construct import from_transformers
from phaselens.models.deepseek_v4.geometry import LayerGeometry, layer_geometry
from phaselens.models.deepseek_v4.memory import MemoryEstimate, estimate_memory
from phaselens.models.deepseek_v4.notices import DeepSeekV4Warning, LayerTypesWarning
from phaselens.models.parts.index_topk import IndexTopKWarning

__all__ = [
    "DeepSeekV4Adapter",
    "DeepSeekV4Cfg",
    "DeepSeekV4Warning",
    "IndexTopKWarning",
    "LayerGeometry",
    "LayerTypesWarning",
    "MemoryEstimate",
    "estimate_memory",
    "from_transformers",
    "layer_geometry",
    "load_hf",
]
