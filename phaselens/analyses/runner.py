"""The one analysis pipeline: an analysis declares what it measures; :func:`run` does everything else.

An analysis (a subclass of :class:`Analysis`: a frozen dataclass of its own settings) declares

* its **items**: nothing to write, the common options say which (task, ``n_per_residue``, ``residues`` or
  ``phase``, ``seed``, ``stride``);
* its **state**: what ``prepare(run)`` computes for every unit (a frozen dataclass), passed to every later
  step; nothing is kept on the analysis;
* its **units** of work and what one unit yields (``fields``: a tuple of arrays), with
  ``compute(run, state, idx)`` for a list of units (one batched call per item block or per group of cells);
* its **result**: ``result(run, state, parts)`` turns the units' arrays into the result object.

:func:`run` does the rest, the same way for every analysis:

1. read the common options from the call's arguments (:meth:`Common.of`) and check everything once
   (:func:`checked`: the model, the common options, then the analysis's own ``check``, which returns the
   checked analysis);
2. resolve the task (``None``: the model's default task), price the run against the memory available and
   build the items (``items.build_items``);
3. ``prepare`` (calibration, a clean pass, ... whatever the units share): the state;
4. split the units across ``torch.distributed`` ranks, keep finished units in the journal under a fingerprint of
   the model, the items and the analysis's settings (resume at any world size), and show one progress bar
   (:func:`phaselens.parallel.distributed.shard_map`);
5. ``result``, then stamp ``metadata``: the model's name and ``analysis_metadata``, the task, the exact
   arguments of the call (read from the public function's signature, defaults included), what the
   analysis notes (``run.metadata(**note)``), the world size and the shards.

An analysis also declares what a run of it runs, as data (:meth:`Analysis.units`: its passes over the items,
its cells, its engine), which ``phaselens.plan`` reads to price it without running it.

Adding an analysis is one module: a subclass and a public function that calls :func:`run`
(docs/architecture.md has a worked example); its result type is a module of :mod:`phaselens.results`.
"""

from __future__ import annotations

import functools
import inspect
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, TypedDict, TypeVar

import numpy as np

from phaselens.analyses.items import PhaseTask, build_items, check_battery_items, check_options
from phaselens.analyses.units import Units
from phaselens.contract.adapting import as_phase_model
from phaselens.contract.protocol import (
    PhaseModel,
    check_model,
    engine_record,
    metadata_of,
    model_name,
    refuse_black_box,
)
from phaselens.contract.strides import check_stride, compression_strides, stride_record
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import InputError
from phaselens.parallel.distributed import block_labels, item_blocks, open_journal, shard_map, sharded
from phaselens.storage.journal import check_journal_path
from phaselens.tasks.batch import TaskBatch

N_BOOTSTRAP = 1000  # the one default number of bootstrap resamples (every analysis that resamples)
# The one default number of items per residue, for every analysis: 128 items give a 95% Wilson interval of at most
# +-8.5 points on a residue's accuracy, and a phase pools M/S residues (+-4.3 points at M/S = 4, the zoo's 24/4
# gives +-3.5), small enough to see a weak phase; an analysis that costs more per item asks for fewer
# explicitly (docs/api.md, "Common options").
N_PER_RESIDUE = 128
LEADING = ("phase", "n_per_residue")  # the common keywords a signature shows first, before the analysis's own
F = TypeVar("F", bound=Callable[..., Any])
A = TypeVar("A", bound="Analysis")
S = TypeVar("S")


class CommonOptions(TypedDict, total=False):
    """The common keywords, written once (docs/api.md, "Common options"; their meaning and defaults:
    :class:`Common`). A public analysis takes them as ``**options: Unpack[CommonOptions]`` (or
    :class:`ResamplingOptions`), and :func:`public` spells them out in its signature, each with its type and
    default (``phase`` and ``n_per_residue`` first, before the analysis's own keywords; the others after them),
    so ``help()`` and ``inspect.signature`` show every keyword and an unknown one is a TypeError."""

    phase: int | Sequence[int] | None
    n_per_residue: int
    residues: Sequence[int] | None
    seed: int
    batch_size: int
    stride: int | None
    progress: bool
    journal: str | os.PathLike | None


class ResamplingOptions(CommonOptions, total=False):
    """The common keywords of an analysis that resamples: :class:`CommonOptions` and ``n_bootstrap``."""

    n_bootstrap: int


@dataclass(frozen=True)
class Common:
    """The options every analysis shares, with one meaning everywhere (docs/api.md, "Common options").

    Attributes:
        n_per_residue: items per residue (ignored when the task is a prepared ``TaskBatch``); default
            :data:`N_PER_RESIDUE` for every analysis.
        residues: residues to cover (default all of ``0..M-1``).
        phase: the phases to cover, an int in ``0..S-1`` or a list of them: the same items as ``residues=`` the
            residues ``r`` with ``r % S`` in ``phase`` (``S``: the analysis stride); a phase outside ``0..S-1``
            is a ResidueError, and ``phase`` with ``residues`` an InputError (say one of them).
        seed: item sampling seed (also seeds resampling).
        batch_size: items per forward.
        stride: fold residues by this stride instead of the model's analysis stride.
        progress: show a progress bar.
        journal: a file path (the result journal): finished units are written there atomically; a rerun resumes.
        n_bootstrap: bootstrap resamples for intervals (where the analysis resamples; 0 skips them).
    """

    n_per_residue: int = N_PER_RESIDUE
    residues: Sequence[int] | None = None
    phase: int | Sequence[int] | None = None
    seed: int = 0
    batch_size: int = 64
    stride: int | None = None
    progress: bool = True
    journal: str | os.PathLike | None = None
    n_bootstrap: int = N_BOOTSTRAP

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Common:
        """The options of a call, by keyword from its arguments (:func:`arguments_of`); an analysis without
        ``n_bootstrap`` resamples nothing (0)."""
        names = {f.name for f in fields(cls)}
        return cls(**{"n_bootstrap": 0, **{k: v for k, v in arguments.items() if k in names}})

    def check(self) -> None:
        """Every common option, once, before anything is built."""
        check_options(n_per_residue=self.n_per_residue, seed=self.seed, batch_size=self.batch_size,
                      stride=self.stride, n_bootstrap=self.n_bootstrap, progress=self.progress)
        if self.phase is not None and self.residues is not None:
            raise InputError(f"pass residues or phase, not both (got residues={self.residues!r}, phase={self.phase!r}): "
                             "phase=p means the residues r with r % S == p, so say one of them.")
        check_journal_path(self.journal)


@dataclass(frozen=True)
class Run:
    """One run of an analysis: the model, the resolved task, its geometry and items, and the options."""

    analysis: str
    model: PhaseModel
    task: PhaseTask | TaskBatch
    spec: PhaseSpec
    batch: TaskBatch
    options: Common
    arguments: dict[str, Any]

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

    def metadata(self, **note: Any) -> dict[str, Any]:
        """What the result carries: model, its analysis_metadata, task, arguments, then what the analysis
        notes (the engine used, the calibration's source, ...)."""
        task = self.task
        spec = task.to_dict() if hasattr(task, "to_dict") else repr(task)
        name = str(task.task) if hasattr(task, "task") else type(task).__name__
        out = {**metadata_of(self.model, **self.arguments), "task": name, "task_spec": spec, **note}
        return {**out, **stride_record(self.model, self.spec), **engine_record(self.model, self.arguments, out)}

    def units(self, compute: Callable[[list[int]], list[Any]], labels: Sequence[str], *, stage: str,
              unit: str = "block", bar_unit: str = "batch", per_call: int = 1, leave: bool = False,
              store: Any = None, progress: bool | None = None) -> list[Any]:
        """Run ``compute`` over units (split across ranks, written to the journal ``store``): one entry per label."""
        return shard_map(compute, list(labels), per_call=per_call, store=store, unit=unit,
                         progress=self.options.progress if progress is None else progress, stage=stage,
                         bar_unit=bar_unit, leave=leave, model=self.model)


@dataclass(frozen=True)
class NoState:
    """The prepared state of an analysis whose units share nothing."""


class Analysis(Generic[S]):
    """What an analysis declares (see the module docstring), without hidden state.

    A subclass is a frozen dataclass of its own settings (the public function's arguments). :meth:`check`
    returns it checked (a copy, never itself changed); :meth:`prepare` returns the typed state ``S`` its units
    share (a frozen dataclass), which :meth:`labels`, :meth:`fingerprint`, :meth:`per_call`, :meth:`compute`
    and :meth:`result` receive. Nothing is set on the analysis after construction (tests/analyses/
    test_stateless.py). Subclasses set the class attributes and implement :meth:`fields`, :meth:`compute`
    and :meth:`result`; the other steps have defaults."""

    name: ClassVar[str]  # the analysis's name (metadata, fingerprints)
    stage: ClassVar[str]  # the progress bar's label
    unit: ClassVar[str] = "block"  # one unit of work: "block" (batch_size items), "cell", "copy", ...
    bar_unit: ClassVar[str] = "batch"
    leave: ClassVar[bool] = False  # keep the bar on screen when done (long runs)
    needs_phases: ClassVar[bool] = False  # refuse one-phase geometry (the phase battery compares phases)
    black_box: ClassVar[bool] = False  # runs on a model that only answers prompts (a served endpoint)

    def check(self: A, model: PhaseModel, options: Common) -> A:
        """The analysis with its own settings checked before any item is built: itself, or a copy with the
        settings normalised (``dataclasses.replace``)."""
        return self

    @classmethod
    def from_arguments(cls: type[A], arguments: Mapping[str, Any]) -> A:
        """The analysis of a call from its arguments (:func:`arguments_of`): its settings are the public
        function's own arguments, by name (``phaselens.plan`` builds it the same way, without running it)."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.init and f.name in arguments})

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """What a run runs, as data (:class:`~phaselens.analyses.units.Units`), for the checked analysis;
        ``items`` is the items' shape (``n``, ``seq_len``, ``modulus``: a built batch, or
        ``phaselens.planning``'s planned items). Default: one forward of every item."""
        return Units()

    def prepare(self, run: Run) -> S:
        """Compute what every unit shares (a calibration, a clean pass, ...): the typed state."""
        return NoState()  # type: ignore[return-value]

    def labels(self, run: Run, state: S) -> list[str]:
        """The units' labels, in order (default: the item blocks)."""
        return block_labels(run.blocks)

    def fields(self, run: Run) -> tuple[str, ...] | None:
        """The names of the arrays one unit yields (the journal's fields)."""
        raise NotImplementedError

    def fingerprint(self, run: Run, state: S) -> dict[str, Any]:
        """Settings beyond the model and the items that change the numbers (the journal's fingerprint)."""
        return {}

    def per_call(self, run: Run, state: S) -> int:
        """Units per ``compute`` call (a batched pass over several cells)."""
        return 1

    def compute(self, run: Run, state: S, idx: list[int]) -> list[Any]:
        raise NotImplementedError

    def result(self, run: Run, state: S, parts: list[Any]) -> Any:
        raise NotImplementedError


def checked(analysis: A, model: PhaseModel, options: Common) -> A:
    """Every check of a call, once, before any item is built: the model, the common options, then the
    analysis's own (the checked analysis)."""
    check_model(model)
    if not analysis.black_box:
        refuse_black_box(model, analysis.name)
    options.check()
    if options.stride is not None:  # the one rule for strides (phaselens.contract.strides)
        check_stride(options.stride, compression_strides(model), what=model_name(model))
    return analysis.check(model, options)


def run(analysis: Analysis[Any], model: PhaseModel, task: Any, arguments: dict[str, Any]) -> Any:
    """Run ``analysis`` on ``model`` with the call's ``arguments`` (:func:`arguments_of`; the common options
    are read from them, :meth:`Common.of`). See the module docstring for the steps."""
    options = Common.of(arguments)
    analysis = checked(analysis, model, options)
    item_options = dict(n_per_residue=options.n_per_residue, residues=options.residues, phase=options.phase,
                        seed=options.seed, stride=options.stride)
    task, spec, batch = build_items(model, task, batch_size=options.batch_size, **item_options)
    if analysis.needs_phases:
        check_battery_items(spec, batch, options.stride, analysis.name)
    r = Run(analysis.name, model, task, spec, batch, options, arguments)
    state = analysis.prepare(r)
    store = None
    if options.journal is not None:  # hashing the weights is cheap next to the run, but only needed to resume
        from phaselens.storage.fingerprints import analysis_fingerprint

        fp = analysis_fingerprint(model, analysis=analysis.name, items=batch.tokens, query_pos=batch.query_pos,
                                  answers=batch.answer, wrong=batch.wrong, batch_size=options.batch_size,
                                  **analysis.fingerprint(r, state))
        store = open_journal(options.journal, fp, analysis.fields(r))
    parts = r.units(lambda idx: analysis.compute(r, state, idx), analysis.labels(r, state), stage=analysis.stage,
                    unit=analysis.unit, bar_unit=analysis.bar_unit, per_call=analysis.per_call(r, state),
                    leave=analysis.leave, store=store)
    return analysis.result(r, state, parts)


def public(fn: F) -> F:
    """Decorate a public analysis function.

    * Its signature is spelled out: ``**options: Unpack[CommonOptions]`` becomes one keyword per common option,
      with its type and its default from :class:`Common` (``help()``, ``inspect.signature`` and
      :func:`arguments_of` read it), and a keyword it does not name is a TypeError, as for any function.
    * Its model argument (the first, or ``model=``) is adapted once
      (:func:`~phaselens.contract.adapting.as_phase_model`: a transformers model, an nnsight envoy or a
      TransformerLens bridge becomes a phaselens model, at the call's ``stride=`` where the model has no
      compression).
    * Its result's metadata gets ``world_size`` and ``shards`` (one entry per sharded stage: which units each
      rank computed, which were resumed)."""
    signature = spelled_out(fn)

    @functools.wraps(fn)
    def adapted(*args: Any, **kwargs: Any) -> Any:
        signature.bind(*args, **kwargs)  # an unknown keyword, or one given twice, is refused as Python would
        stride = kwargs.get("stride")
        if args:
            args = (as_phase_model(args[0], stride=stride), *args[1:])
        elif "model" in kwargs:
            kwargs["model"] = as_phase_model(kwargs["model"], stride=stride)
        return fn(*args, **kwargs)

    wrapper = sharded(adapted)
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    return wrapper


def spelled_out(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature with its ``**options: Unpack[...]`` written out as keyword-only parameters, each with its
    annotation and its default from :class:`Common`: ``fn(model, [heads,] task=None, *, phase=None,
    n_per_residue=N_PER_RESIDUE, <its own keywords>, <the other common options>)``."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        return sig
    annotation = params[-1].annotation
    if isinstance(annotation, str):  # postponed annotations: read in the defining module
        annotation = eval(annotation, fn.__globals__)  # noqa: S307 (our own source)
    (keywords,) = typing.get_args(annotation)
    defaults = {f.name: f.default for f in fields(Common)}
    common = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=hint)
              for name, hint in typing.get_type_hints(keywords).items()]
    own = params[:-1]
    twice = sorted({p.name for p in own} & {p.name for p in common})
    if twice:  # a programming error in the analysis, raised when it is decorated
        raise TypeError(f"{fn.__name__} declares {', '.join(twice)}, which **options: Unpack[...] already spells out "
                        "(with the one default of every analysis); remove them from its signature.")
    at = next((i for i, p in enumerate(own) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(own))
    lead = [p for p in common if p.name in LEADING]
    rest = [p for p in common if p.name not in LEADING]
    return sig.replace(parameters=[*own[:at], *lead, *own[at:], *rest])


def arguments_of(fn: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The exact arguments of a call of the public ``fn`` from its ``locals()``: every parameter of its
    (spelled-out) signature but ``model`` and ``task``, defaults included, paths as strings (a result's
    ``metadata["arguments"]``; :meth:`Common.of` reads the common options from them)."""
    given = dict(values)
    for p in inspect.signature(inspect.unwrap(fn)).parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            given.update(values.get(p.name) or {})
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in ("model", "task"):
            continue
        value = given.get(name, p.default)
        out[name] = str(value) if isinstance(value, os.PathLike) else value
    return out


__all__ = ["Analysis", "Common", "CommonOptions", "N_BOOTSTRAP", "N_PER_RESIDUE", "NoState", "ResamplingOptions", "Run",
           "arguments_of", "checked", "public", "run", "spelled_out"]
