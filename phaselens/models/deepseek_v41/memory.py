"""Memory a DeepSeek-V4.1 forward needs, from the model's sizes alone (a meta-device model will do): the
``estimate_memory`` capability, computed from the model's
:func:`~phaselens.models.deepseek_v41.layer_table.layer_table` (which says what each tensor is).

:func:`estimate_memory` counts, for ``batch`` sequences of ``tokens`` tokens run as :meth:`DeepSeekV41.forward`
runs them (optionally prefilled in pieces of ``chunk``): weights, the cache after the run, the largest fp32 score
tensor of one call (budget four times it), the other transients of one call, and the logits.
"""

from __future__ import annotations

from typing import Any, Literal

from phaselens.contract.memory import MemoryEstimate
from phaselens.models.deepseek_v41.layer_table import layer_table
from phaselens.models.parts.chunks import plan_chunks


def estimate_memory(model: Any, tokens: int, *, batch: int = 1, chunk: int | None = None,
                    query_len: int | None = None, logits: Literal["all", "query"] = "all") -> MemoryEstimate:
    """Estimate the memory of ``model(tokens, chunk=chunk, query_len=query_len, logits=logits)``."""
    T = int(tokens)
    plan = plan_chunks(T, chunk, query_len if chunk is not None else None)  # unchunked: one call
    rows = T if logits == "all" else plan.query_rows if chunk else int(query_len or T)
    return layer_table(model).memory(T, plan.calls, batch=batch, chunk=chunk, query_rows=plan.query_rows,
                                     logit_rows=rows)


__all__ = ["estimate_memory"]
