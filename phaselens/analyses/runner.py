"""The one analysis pipeline: an analysis declares what it measures; :func:`run` does everything else.

An analysis (a subclass of :class:`Analysis`) declares

* its **items**: nothing to write, the common options say which (task, ``n_per_residue``, ``residues`` or
  ``phase``, ``seed``, ``stride``);
* its **units** of work and what one unit yields (``fields``: a tuple of arrays), with ``compute`` for a list
  of units (one batched call per item block or per group of cells);
* its **result**: ``result(run, parts)`` turns the units' arrays into the result object.

:func:`run` does the rest, the same way for every analysis:

1. check the model and the common options (:class:`Common`), then the analysis's own (``check``);
2. resolve the task (``None``: the model's default task), price the run against the memory available and
   build the items (``items.build_items``; a dry run only prices them, ``items.plan_items``);
3. ``prepare`` (calibration, a clean pass, ... whatever the units share);
4. split the units across ``torch.distributed`` ranks, checkpoint finished units under a fingerprint of the
   model, the items and the analysis's settings (resume at any world size), and show one progress bar
   (:func:`phaselens.runtime.distributed.shard_map`);
5. ``result``, then stamp ``metadata``: the model's name and ``analysis_metadata``, the task, the exact
   arguments of the call (read from the public function's signature, defaults included), what the
   analysis adds (``run.note``), the world size and the shards.

Adding an analysis is one module: a subclass and a public function that calls :func:`run`
(docs/architecture.md has a worked example).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from phaselens.analyses.items import build_items, check_options
from phaselens.contract.adapting import as_phase_model
from phaselens.contract.protocol import check_model, metadata_of, refuse_black_box
from phaselens.core.errors import InputError
from phaselens.runtime.checkpoints import check_checkpoint_path
from phaselens.runtime.distributed import block_labels, item_blocks, open_checkpoint, shard_map, sharded

N_BOOTSTRAP = 1000  # the one default number of bootstrap resamples (every analysis that resamples)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Common:
    """The options every analysis shares, with one meaning everywhere (docs/api.md, "Common options").

    Attributes:
        n_per_residue: items per residue (ignored when the task is a prepared ``TaskBatch``).
        residues: residues to cover (default all of ``0..M-1``); ``phase`` selects the residues of some phases.
        seed: item sampling seed (also seeds resampling).
        batch_size: items per forward.
        stride: fold residues by this stride instead of the model's analysis stride.
        progress: show a progress bar.
        checkpoint: a file path: finished units are written there atomically and a rerun resumes.
        n_bootstrap: bootstrap resamples for intervals (where the analysis resamples; 0 skips them).
    """

    n_per_residue: int
    residues: Sequence[int] | None = None
    phase: Any = None
    seed: int = 0
    batch_size: int = 64
    stride: int | None = None
    progress: bool = True
    checkpoint: str | os.PathLike | None = None
    n_bootstrap: int = N_BOOTSTRAP

    def check(self) -> None:
        check_options(n_per_residue=self.n_per_residue, seed=self.seed, batch_size=self.batch_size,
                      stride=self.stride, n_bootstrap=self.n_bootstrap, progress=self.progress)
        check_checkpoint_path(self.checkpoint)


@dataclass
class Run:
    """One run of an analysis: the model, the resolved task, its geometry and items, and the options.

    ``note`` collects what the analysis adds to the result's metadata (the engine used, the calibration's
    source, ...); ``state`` holds what ``prepare`` computed for the units.
    """

    analysis: str
    model: Any
    task: Any
    spec: Any
    batch: Any
    options: Common
    arguments: dict[str, Any]
    note: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def stride(self) -> int:
        return int(self.spec.stride)

    @property
    def modulus(self) -> int:
        return int(self.batch.modulus)

    @property
    def blocks(self) -> list[slice]:
        """The item blocks of ``batch_size`` items (the same boundaries at every world size)."""
        return item_blocks(len(self.batch), self.options.batch_size)

    def covered(self) -> np.ndarray | None:
        """The residues evaluated when only some were asked for (``None``: all of them)."""
        if self.options.residues is None and self.options.phase is None:
            return None
        return np.unique(self.batch.frame["residue"].to_numpy())

    def metadata(self) -> dict[str, Any]:
        """What the result carries: model, its analysis_metadata, task, arguments, then ``note``."""
        task = self.task
        spec = task.to_dict() if hasattr(task, "to_dict") else repr(task)
        name = str(task.task) if hasattr(task, "task") else type(task).__name__
        return {**metadata_of(self.model, **self.arguments), "task": name, "task_spec": spec, **self.note}

    def units(self, compute: Callable[[list[int]], list[Any]], labels: Sequence[str], *, stage: str,
              unit: str = "block", bar_unit: str = "batch", per_call: int = 1, leave: bool = False,
              store: Any = None, progress: bool | None = None) -> list[Any]:
        """Run ``compute`` over units (split across ranks, checkpointed to ``store``): one entry per label."""
        return shard_map(compute, list(labels), per_call=per_call, store=store, unit=unit,
                         progress=self.options.progress if progress is None else progress, stage=stage,
                         bar_unit=bar_unit, leave=leave, model=self.model)


class Analysis:
    """What an analysis declares (see the module docstring). Subclasses set the class attributes and
    implement :meth:`compute` and :meth:`result`; the other steps have defaults."""

    name: ClassVar[str]  # the analysis's name (metadata, fingerprints)
    stage: ClassVar[str]  # the progress bar's label
    unit: ClassVar[str] = "block"  # one unit of work: "block" (batch_size items), "cell", "copy", ...
    bar_unit: ClassVar[str] = "batch"
    leave: ClassVar[bool] = False  # keep the bar on screen when done (long runs)
    needs_phases: ClassVar[bool] = False  # refuse one-phase geometry (the phase battery compares phases)
    black_box: ClassVar[bool] = False  # runs on a model that only answers prompts (a served endpoint)

    def check(self, model: Any, options: Common) -> None:
        """Check the analysis's own options (before any item is built)."""

    def dry_run(self, run: Run) -> Any:
        """What to return instead of running, once the items are built (a plan), or ``None`` to run. When
        :meth:`prices_only`, ``run.batch`` is a :class:`~phaselens.runtime.planning.PlannedItems`: the items'
        shape, not the items."""
        return None

    def prices_only(self) -> bool:
        """Whether this call is a dry run that needs only the items' shape (nothing the size of them is built)."""
        return False

    def prepare(self, run: Run) -> None:
        """Compute what every unit shares (default: nothing)."""

    def labels(self, run: Run) -> list[str]:
        """The units' labels, in order (default: the item blocks)."""
        return block_labels(run.blocks)

    def fields(self, run: Run) -> tuple[str, ...]:
        """The names of the arrays one unit yields (the checkpoint's fields)."""
        raise NotImplementedError

    def fingerprint(self, run: Run) -> dict[str, Any]:
        """Settings beyond the model and the items that change the numbers (the checkpoint's fingerprint)."""
        return {}

    def per_call(self, run: Run) -> int:
        """Units per ``compute`` call (a batched pass over several cells)."""
        return 1

    def compute(self, run: Run, idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        raise NotImplementedError

    def result(self, run: Run, parts: list[tuple[np.ndarray, ...]]) -> Any:
        raise NotImplementedError


def run(analysis: Analysis, model: Any, task: Any, options: Common, arguments: dict[str, Any]) -> Any:
    """Run ``analysis`` on ``model`` (see the module docstring for the steps)."""
    check_model(model)
    if not analysis.black_box:
        refuse_black_box(model, analysis.name)
    options.check()
    analysis.check(model, options)
    if options.phase is not None and options.residues is not None:
        raise InputError("pass residues or phase, not both.")
    if analysis.prices_only():  # a dry run: priced without building the run's items
        from phaselens.analyses.items import plan_items

        task, spec, items = plan_items(model, task, n_per_residue=options.n_per_residue, residues=options.residues,
                                       phase=options.phase, seed=options.seed, stride=options.stride)
        return analysis.dry_run(Run(analysis.name, model, task, spec, items, options, arguments))
    task, spec, batch = build_items(model, task, n_per_residue=options.n_per_residue, residues=options.residues,
                                    phase=options.phase, seed=options.seed, stride=options.stride,
                                    batch_size=options.batch_size)
    if analysis.needs_phases:
        from phaselens.analyses.items import check_battery_items

        check_battery_items(spec, batch, options.stride, analysis.name)
    r = Run(analysis.name, model, task, spec, batch, options, arguments)
    plan = analysis.dry_run(r)
    if plan is not None:
        return plan
    analysis.prepare(r)
    labels = analysis.labels(r)
    store = None
    if options.checkpoint is not None:  # hashing the weights is cheap next to the run, but only needed to resume
        from phaselens.runtime.fingerprints import analysis_fingerprint

        fp = analysis_fingerprint(model, analysis=analysis.name, items=batch.tokens, query_pos=batch.query_pos,
                                  answers=batch.answer, wrong=batch.wrong, batch_size=options.batch_size,
                                  **analysis.fingerprint(r))
        store = open_checkpoint(options.checkpoint, fp, analysis.fields(r))
    parts = r.units(lambda idx: analysis.compute(r, idx), labels, stage=analysis.stage, unit=analysis.unit,
                    bar_unit=analysis.bar_unit, per_call=analysis.per_call(r), leave=analysis.leave, store=store)
    return analysis.result(r, parts)


def public(fn: F) -> F:
    """Decorate a public analysis function: its model argument (the first, or ``model=``) is adapted once
    (:func:`~phaselens.contract.adapting.as_phase_model`: a transformers model, an nnsight envoy or a
    TransformerLens bridge becomes a phaselens model, at the call's ``stride=`` where the model has no
    compression), and its result's metadata gets ``world_size`` and ``shards`` (one entry per sharded stage:
    which units each rank computed, which were resumed)."""

    @functools.wraps(fn)
    def adapted(*args: Any, **kwargs: Any) -> Any:
        stride = kwargs.get("stride")
        if args:
            args = (as_phase_model(args[0], stride=stride), *args[1:])
        elif "model" in kwargs:
            kwargs["model"] = as_phase_model(kwargs["model"], stride=stride)
        return fn(*args, **kwargs)

    return sharded(adapted)  # type: ignore[return-value]


def arguments_of(fn: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The exact arguments of a call of the public ``fn`` from its ``locals()``: every parameter of its
    signature but ``model`` and ``task``, paths as strings (a result's ``metadata["arguments"]``)."""
    out = {}
    for name in inspect.signature(inspect.unwrap(fn)).parameters:
        if name in ("model", "task"):
            continue
        value = values.get(name)
        out[name] = str(value) if isinstance(value, os.PathLike) else value
    return out


__all__ = ["Analysis", "Common", "N_BOOTSTRAP", "Run", "arguments_of", "public", "run"]
