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


def build_items(
    model: Any,
    task: Any,
    *,
    n_per_residue: int,
    residues: Any = None,
    phase: Any = None,
    seed: int = 0,
    stride: int | None = None,
) -> tuple[Any, Any, Any]:
    """The shared preamble of every analysis: ``(task, spec, batch)``.

    Resolves the task (``model.default_task`` when ``None``), checks it fits the context and that
    ``n_per_residue >= 1``, picks the analysis geometry (``stride`` overrides it, keeping the origin), and
    builds the items for ``residues`` (or for the residues of ``phase``, an int or a list of phases).
    """
    from phaselens.errors import ResidueError, TaskError
    from phaselens.tasks.residues import check_modulus

    task = resolve_task(model, task)
    check_fits(model, task)
    if not isinstance(n_per_residue, int) or n_per_residue < 1:
        raise TaskError(f"n_per_residue must be an integer >= 1, got {n_per_residue!r}.")
    spec = model.analysis_spec if stride is None else PhaseSpec(stride, origin=model.analysis_spec.origin)
    if phase is not None:
        if residues is not None:
            raise TaskError("pass residues or phase, not both.")
        modulus = check_modulus(spec, getattr(task, "modulus", None))
        phases = [phase] if isinstance(phase, int) else [int(p) for p in phase]
        bad = [p for p in phases if not 0 <= p < spec.stride]
        if bad:
            raise ResidueError(f"phase {bad} is outside 0..{spec.stride - 1} (phases are residues mod {spec.stride}).")
        residues = [r for r in range(modulus) if r % spec.stride in set(phases)]
    batch = task.build(spec, n_per_residue=n_per_residue, residues=residues, seed=seed)
    return task, spec, batch
