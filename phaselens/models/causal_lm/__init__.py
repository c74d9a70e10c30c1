"""Any transformers causal LM behind phaselens' :class:`~phaselens.contract.protocol.PhaseModel` protocol, analysed
at a stride the user gives: the paper's full-attention control, measured in the compressed models' geometry.

* :func:`from_transformers` wraps a model object (a transformers ``...ForCausalLM``, an nnsight envoy of one, or
  the model of a TransformerLens bridge), leaving it exactly as it was;
* :func:`load_causal_lm` loads a local checkpoint directory (``phaselens.load("hf:DIR", stride=4)``);
* :class:`CausalLMAdapter` is the result: TransformerLens hook names (``hook_z`` at the output projection's
  input, ``hook_pattern`` from the model's own eager attention), and the query-suffix engine over the model's
  own ``DynamicCache``.

See ``docs/causal_lm.md``.
"""

from __future__ import annotations

import phaselens.parallel.quiet_tqdm  # noqa: F401  (first: before anything imports transformers)
from phaselens.models.causal_lm.adapter import CausalLMAdapter, CausalLMCfg
from phaselens.models.causal_lm.construct import from_transformers, load_causal_lm
from phaselens.models.causal_lm.engine import CausalSuffixEngine
from phaselens.models.causal_lm.layout import Layout, model_layout

__all__ = [
    "CausalLMAdapter",
    "CausalLMCfg",
    "CausalSuffixEngine",
    "Layout",
    "from_transformers",
    "load_causal_lm",
    "model_layout",
]
