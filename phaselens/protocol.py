"""The structural protocol every analysis programs against.

Two kinds of model satisfy it: :class:`~phaselens.models.CompressedTransformer` and the DeepSeek-V4
adapter from :func:`phaselens.from_hf`. Analyses never check concrete classes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from phaselens.errors import ContextLengthError, NoDefaultTaskError
from phaselens.geometry import PhaseSpec


@runtime_checkable
class PhaseModel(Protocol):
    """What phaselens needs from a model.

    * ``cfg``: ``n_layers``, ``n_heads``, ``n_key_value_heads``, ``d_head``, ``n_ctx``, ``device``;
    * ``phase_specs``: per-layer :class:`PhaseSpec` (``None`` where a layer does not compress);
    * ``analysis_spec``: the geometry that defines phases for analysis;
    * ``default_task``: the task a model card's numbers came from, or ``None``;
    * ``__call__(tokens [B, T]) -> logits [B, T, vocab]``.
    """

    @property
    def cfg(self) -> Any: ...

    @property
    def phase_specs(self) -> list[PhaseSpec | None]: ...

    @property
    def analysis_spec(self) -> PhaseSpec: ...

    default_task: Any

    def __call__(self, tokens: Tensor, *args: Any, **kwargs: Any) -> Any: ...


def resolve_task(model: Any, task: Any) -> Any:
    """``task``, or the model's ``default_task``; a clear error when neither exists."""
    if task is not None:
        return task
    default = getattr(model, "default_task", None)
    if default is None:
        raise NoDefaultTaskError(
            f"{type(model).__name__} has no default_task; pass a task, e.g. "
            "phaselens.evaluate(model, phaselens.tasks.KVRecall(...)). Zoo models carry one."
        )
    return default


def check_fits(model: Any, task: Any) -> None:
    """Raise ContextLengthError if ``task`` needs more slots than the model's context."""
    n_ctx = int(getattr(model.cfg, "n_ctx", 0) or 0)
    need = int(task.seq_len(model.analysis_spec)) if callable(task.seq_len) else int(task.seq_len)
    if n_ctx and need > n_ctx:
        raise ContextLengthError(
            f"the task needs {need} tokens but the model's context is {n_ctx}; shorten the task "
            f"(fewer records or less filler) to at most {n_ctx} tokens."
        )
