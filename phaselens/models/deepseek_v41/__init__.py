"""DeepSeek-V4.1 (period 2): phaselens' own implementation of the text model, loaded from a local checkpoint.

* :func:`load_v41` (``phaselens.load("hf:DIR")``) reads ``config.json`` (``text_config``), the sharded,
  quantized safetensors and, for Engram, ``tokenizer.json``;
* :class:`DeepSeekV41` is the model, Engram included (:mod:`.engram`, :mod:`.engram_hash`): the phaselens model
  contract, TransformerLens hooks, a real cache;
* :class:`V41Config` is the parsed config with the layers' sharing roles (:meth:`V41Config.topology`).

See ``docs/deepseek_v41.md``.
"""

from __future__ import annotations

from phaselens.models.deepseek_v41.cache import V41Cache
from phaselens.models.deepseek_v41.checkpoint import is_v41_checkpoint, load_v41
from phaselens.models.deepseek_v41.config import LayerRole, V41Config
from phaselens.models.deepseek_v41.model import DeepSeekV41, V41Cfg
from phaselens.models.deepseek_v41.notices import DeepSeekV41Warning, EngramDroppedWarning
from phaselens.models.parts.index_topk import IndexTopKWarning

__all__ = [
    "DeepSeekV41",
    "DeepSeekV41Warning",
    "EngramDroppedWarning",
    "IndexTopKWarning",
    "LayerRole",
    "V41Cache",
    "V41Cfg",
    "V41Config",
    "is_v41_checkpoint",
    "load_v41",
]
