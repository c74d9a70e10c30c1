"""The preamble every analysis shares: check the common options, resolve the task, build the items.

Every analysis that samples items takes the same keyword options with the same meaning (``n_per_residue``,
``residues``, ``seed``, ``batch_size``, ``progress``, ``stride``); :func:`check_options` checks them, once per
call (``runner.Common.check``), so a bad value gets the same clear error everywhere. Numpy integers are
integers. :func:`build_items` and :func:`prepare_task` take options already checked.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from phaselens.core.checks import MAX_RESAMPLES, MAX_SEED, as_int
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import (
    ContextLengthError,
    InputError,
    NoDefaultTaskError,
    ResidueError,
    StatsInputError,
    TaskError,
)

if TYPE_CHECKING:
    from phaselens.tasks.batch import TaskBatch


class PhaseTask(Protocol):
    """What an analysis needs of a task: its items, built for a geometry (every phaselens task; a prepared
    :class:`~phaselens.tasks.batch.TaskBatch` is used as it is instead)."""

    def build(self, spec: PhaseSpec, *, n_per_residue: int, residues: Sequence[int] | None = None,
              seed: int = 0) -> TaskBatch: ...


def check_options(*, n_per_residue: Any = 1, seed: Any = 0, batch_size: Any = 1, stride: Any = None,
                  n_bootstrap: Any = 0, n_permutations: Any = 1, progress: Any = False) -> None:
    """Raise a clear error for a bad value of a shared option."""
    if isinstance(n_per_residue, bool) or not isinstance(n_per_residue, numbers.Integral) or n_per_residue < 1:
        raise TaskError(f"n_per_residue must be an integer >= 1, got {n_per_residue!r}.")
    as_int("seed", seed, minimum=0, maximum=MAX_SEED, fix="Seeds are non-negative integers below 2**63.")
    as_int("batch_size", batch_size, minimum=1, fix="It is the number of items per forward.")
    as_int("n_bootstrap", n_bootstrap, minimum=0, maximum=MAX_RESAMPLES,
           fix="It is the number of bootstrap resamples (0: none; a million is more than enough).")
    as_int("n_permutations", n_permutations, minimum=1, maximum=MAX_RESAMPLES,
           fix="It is the number of permutations (e.g. 2000; a million is more than enough).")
    if stride is not None:
        as_int("stride", stride, minimum=1, fix="Pass None to use the model's own analysis stride.")
    if not isinstance(progress, bool):
        raise InputError(f"progress must be True or False, got {progress!r}.")


def check_task(task: Any) -> Any:
    """A task object (anything with ``build``): strings and other values are refused with the fix."""
    if isinstance(task, type):
        raise TaskError(f"task is the class {task.__name__}, not a task; make one: task={task.__name__}(...).")
    if task is None or callable(getattr(task, "build", None)) or is_batch(task):
        return task
    phases = isinstance(task, numbers.Integral) or (isinstance(task, list | tuple) and task
                                                    and all(isinstance(t, numbers.Integral) for t in task))
    hint = f" To select phases, pass them by keyword: phase={task!r}." if phases else ""
    raise TaskError(
        f"task must be a phaselens task (e.g. phaselens.tasks.KVRecall(...)) or a TaskBatch, got "
        f"{type(task).__name__} {task!r:.60}; pass None to use the model's default task.{hint}"
    )


def is_batch(obj: Any) -> bool:
    """Whether ``obj`` is a prepared :class:`~phaselens.tasks.TaskBatch` (items already built)."""
    return all(hasattr(obj, a) for a in ("tokens", "query_pos", "frame", "modulus", "spec"))


def resolve_task(model: Any, task: Any) -> Any:
    """``task``, or the model's ``default_task``; a clear error when neither exists."""
    task = check_task(task)
    if task is not None:
        return task
    default = model.default_task
    if default is None:
        raise NoDefaultTaskError(
            f"{type(model).__name__} has no default_task; pass a task, e.g. "
            "phaselens.evaluate(model, phaselens.tasks.KVRecall(...)). Zoo models carry one."
        )
    return default


def check_fits(model: Any, task: Any) -> None:
    """Raise ContextLengthError if ``task`` needs more slots than the model's context."""
    n_ctx = model.dims.n_ctx
    need = int(task.seq_len(model.dims.analysis_spec)) if callable(task.seq_len) else int(task.seq_len)
    if n_ctx and need > n_ctx:
        raise ContextLengthError(
            f"the task needs {need} tokens but the model's context is {n_ctx}; shorten the task "
            f"(fewer records or less filler) to at most {n_ctx} tokens."
        )


def check_battery_items(spec: PhaseSpec, batch: Any, stride: Any, what: str) -> None:
    """Before any forward: the phase battery compares at least two phases (a subset of residues is fine:
    the battery then runs over the residues present).

    One phase is what a model without compressed layers has when no ``stride`` is given; the fix names
    ``stride=``.
    """
    if spec.stride < 2:
        given = "" if stride is None else f" (stride={stride})"
        raise StatsInputError(
            f"{what} compares phases, but the analysis stride is {spec.stride}{given}, so every item has phase 0 "
            "(a model without compressed layers has stride 1); pass stride=S, the stride of the compressed "
            "model you compare it with (e.g. stride=4)."
        )


def analysis_geometry(model: Any, stride: int | None) -> PhaseSpec:
    """The model's analysis geometry, or the same origin with another ``stride``."""
    spec = model.dims.analysis_spec
    return spec if stride is None else PhaseSpec(int(stride), origin=spec.origin)


def check_batch_geometry(model: Any, batch: Any, stride: Any = None) -> PhaseSpec:
    """The analysis geometry of a prepared ``batch``: the model's (or ``stride=``'s), which the batch must have
    been built for. Its ``residue`` and ``phase`` columns count from ``batch.spec.origin`` mod its stride, so a
    batch built for another origin or stride would be scored at other phases than its columns say: refused
    (TaskError), with both geometries and the fix."""
    want = analysis_geometry(model, stride)
    have = batch.spec
    if (have.stride, have.origin) == (want.stride, want.origin):
        return want if stride is not None else have
    if stride is None:
        source, how = "the model's analysis_spec", "model.analysis_spec"
    else:
        source, how = f"stride={stride}", f"phaselens.PhaseSpec({want.stride}, origin={want.origin})"
    also = (f"; or pass stride={have.stride} to read phases at the batch's own stride" if stride is None
            and have.origin == want.origin else "")
    raise TaskError(
        f"the TaskBatch was built for stride {have.stride}, origin {have.origin}, but this analysis reads phases at "
        f"stride {want.stride}, origin {want.origin} ({source}): the batch's phase and residue columns would name "
        f"other phases. Rebuild it: task.build({how}, n_per_residue=...), or pass the task itself (the analysis "
        f"then builds the items){also}.")


def phase_residues(spec: PhaseSpec, modulus: int, phase: Any) -> list[int]:
    """The residues ``0..modulus-1`` whose phase is ``phase`` (an int or a list of ints)."""
    raw = [phase] if isinstance(phase, numbers.Number) else list(phase)
    phases = [as_int("phase", p) for p in raw]
    if not phases:
        raise ResidueError(f"phase is empty; pass one phase in 0..{spec.stride - 1}, a list of them, or None (all).")
    bad = [p for p in phases if not 0 <= p < spec.stride]
    if bad:
        raise ResidueError(f"phase {bad or phases} is outside 0..{spec.stride - 1} (phases are residues mod "
                           f"{spec.stride}).")
    return [r for r in range(modulus) if r % spec.stride in set(phases)]


def build_items(
    model: Any,
    task: Any,
    *,
    n_per_residue: int,
    residues: Sequence[int] | None = None,
    phase: Any = None,
    seed: int = 0,
    stride: int | None = None,
    batch_size: int | None = None,
) -> tuple[Any, PhaseSpec, Any]:
    """The shared preamble of every analysis: ``(task, spec, batch)``.

    ``task`` may be a task (``None``: the model's default task) or a prepared ``TaskBatch``, used as it is
    (``residues`` or ``phase`` then select its rows; ``n_per_residue`` and ``seed`` do not apply). For a
    task, checks the task fits the context, picks the analysis geometry (``stride`` overrides it,
    keeping the origin), prices the run before anything is allocated (the items, and one forward of
    ``batch_size`` of them: :func:`phaselens.runtime.budget.price_run` raises ``ResourceError`` when it
    would not fit) and builds the items for ``residues`` or for the residues of ``phase``. The items' ids
    must lie in the model's vocabulary.
    """
    from phaselens.runtime.budget import price_run

    task, spec, residues, shape = prepare_task(model, task, n_per_residue=n_per_residue, residues=residues, phase=phase,
                                           seed=seed, stride=stride)
    check_materialized(model)
    if is_batch(task):
        batch = select_rows(task, spec, residues)
        price_run(model, n_items=len(batch), seq_len=batch.seq_len, per_residue=None, n_residues=0,
                  batch_size=batch_size, query_rows=_query_rows(batch))
        check_ids(model, batch)
        return task, spec, batch
    if shape is not None:
        n_res, T = shape
        price_run(model, n_items=int(n_per_residue) * n_res, seq_len=T, per_residue=int(n_per_residue),
                  n_residues=n_res, batch_size=batch_size)
    batch = task.build(spec, n_per_residue=int(n_per_residue), residues=residues, seed=int(seed))
    check_ids(model, batch)
    return task, spec, batch


def prepare_task(model: Any, task: Any, *, n_per_residue: Any, residues: Any, phase: Any, seed: Any,
             stride: Any) -> tuple[Any, PhaseSpec, Any, tuple[int, int] | None]:
    """The task, its geometry and residues, before any item is built (what :func:`build_items` and
    ``phaselens.plan``'s planned items share; the options are checked already): ``(task, spec, residues,
    (n_res, T))`` (the last ``None`` for a prepared batch, or when the task cannot say its length before
    building)."""
    from phaselens.tasks.residues import check_modulus, check_residues

    task = resolve_task(model, task)
    if is_batch(task):
        spec = check_batch_geometry(model, task, stride)
        if phase is not None:
            residues = phase_residues(spec, task.modulus, phase)
        return task, spec, residues, None
    check_fits(model, task)
    spec = analysis_geometry(model, stride)
    modulus = check_modulus(spec, getattr(task, "modulus", None))
    if phase is not None:
        residues = phase_residues(spec, modulus, phase)
    n_res = len(check_residues(residues, modulus))
    try:
        T = int(task.seq_len(spec)) if callable(task.seq_len) else int(task.seq_len)
    except Exception:  # a task that cannot say its length before building: priced after, by its forward
        return task, spec, residues, None
    return task, spec, residues, (n_res, T)


def select_rows(batch: Any, spec: PhaseSpec, residues: Any) -> Any:
    from phaselens.tasks.residues import check_residues

    if residues is not None:
        keep = np.isin(batch.frame["residue"].to_numpy(), check_residues(residues, batch.modulus))
        batch = batch[np.flatnonzero(keep)]
    if len(batch) == 0:
        raise TaskError("the items are empty (a TaskBatch of 0 rows, or no row at the requested residues); "
                        "pass a batch with items, or build one with n_per_residue >= 1.")
    return batch


def _query_rows(batch: Any) -> int:
    return int(batch.seq_len - int(batch.query_pos.min())) if len(batch) else 1


def check_materialized(model: Any) -> None:
    """Refuse a model whose weights are on the meta device (shapes without values: nothing can be computed)."""
    from phaselens.contract.protocol import module_of

    module = module_of(model)
    if module is not None and any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise InputError(
            f"{type(model).__name__} has weights on the meta device (shapes without values), so nothing can be "
            "computed; load real weights (e.g. phaselens.load(..., device='cpu')), or use "
            "phaselens.plan(model, 'specialization_map', ...), which only prices a run."
        )


def check_ids(model: Any, batch: Any) -> None:
    """The items' token, answer and distractor ids must lie in ``0..vocab-1`` of the model."""
    vocab = int(getattr(model.dims, "d_vocab", 0) or 0)
    for name in ("tokens", "answer", "wrong", "corrupted"):
        x = getattr(batch, name)
        if x.numel() == 0:
            continue
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or (vocab and hi >= vocab):
            what = {"answer": "answer ids", "wrong": "distractor (wrong) ids", "tokens": "token ids",
                    "corrupted": "corrupted token ids"}[name]
            raise InputError(
                f"the items' {what} span {lo}..{hi}, outside the model's vocabulary 0..{vocab - 1}; build the items "
                "for this model's tokenizer (every id must be a valid token id).")
