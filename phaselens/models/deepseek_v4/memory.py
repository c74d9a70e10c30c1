"""Memory a DeepSeek-V4 forward needs, from the model's sizes alone (a meta-device model will do): the
``estimate_memory`` capability of the adapter, computed from the model's
:func:`~phaselens.models.deepseek_v4.layer_table.layer_table` (which says what each tensor is).

:func:`estimate_memory` counts, for ``batch`` sequences of ``tokens`` tokens run as the adapter runs them
(optionally prefilled in chunks, see :mod:`.prefill`): ``weights`` (every parameter and buffer as held),
``cache`` (the ``DynamicCache`` after the run; nothing after one uncached call), ``attention`` (the largest
attention-probability tensor of one call; budget about four times it) and ``logits``. It leaves the other
transients out (``activations`` 0): the adapter's run-time price has always counted these four, while
``phaselens plan`` adds the table's fp32 hyper-connection streams.
"""

from __future__ import annotations

from typing import Any, Literal

from phaselens.contract.memory import MemoryEstimate
from phaselens.models.deepseek_v4.layer_table import layer_table
from phaselens.models.parts.chunks import plan_chunks


def estimate_memory(
    model: Any,
    tokens: int,
    *,
    batch: int = 1,
    chunk: int | None = None,
    query_len: int | None = None,
    logits: Literal["all", "query"] = "all",
) -> MemoryEstimate:
    """Estimate the memory of ``adapter(tokens, chunk=chunk, query_len=query_len, logits=logits)``.

    Args:
        model: a :class:`DeepSeekV4Adapter` or a transformers ``DeepseekV4ForCausalLM`` (weights may be on the
            meta device: only shapes and dtypes are read).
        tokens: sequence length ``T``; batch: sequences per call; chunk, query_len, logits: as the adapter's,
            except that ``chunk=None`` with a ``query_len`` counts the prefix as one cached call and then the
            query (:func:`~phaselens.models.parts.chunks.plan_chunks`: the query engine's prefill, which
            ``phaselens.planning`` prices this way), where the adapter's own forward is one uncached call.
    """
    T = int(tokens)
    plan = plan_chunks(T, chunk, query_len)
    rows = T if logits == "all" else plan.query_rows
    e = layer_table(model).memory(T, plan.calls, batch=batch, chunk=chunk, query_rows=plan.query_rows,
                                  logit_rows=rows, cached=bool(plan.prefix))
    return MemoryEstimate(e.tokens, e.batch, e.chunk, e.query_len, e.weights, e.cache, e.attention, e.logits)


__all__ = ["MemoryEstimate", "estimate_memory"]
