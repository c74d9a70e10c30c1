"""``phaselens.plan``: what a run costs, before anything runs.

``plan(model, analysis, task, **options)`` takes the analysis by name (``"specialization_map"``) or as its
function (``phaselens.ablate``) and the options that call would take; it checks them as the call would, then
prices the run from what the analysis declares (:meth:`~phaselens.analyses.runner.Analysis.units`) without
running the model or building its items:

* a model in this process: a :class:`~phaselens.planning.run_plan.Plan` (cells, model calls, token passes,
  the peak memory, the host memory the items take);
* a served model (a black box): a :class:`~phaselens.runtime.request_plan.RequestPlan` (requests, prompt
  tokens, what a prefix cache skips, the time at ``prefill_tokens_per_s``);
* a checkpoint (``"hf:DIR"`` or a directory; ``config.json`` alone is enough): a
  :class:`~phaselens.planning.checkpoint_report.ModelPlan` (weights, GPUs, the time of a forward and of a
  per-head map), for ``specialization_map``; the options are ``phaselens plan``'s
  (:func:`~phaselens.planning.checkpoint_plan.plan_model`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

from phaselens.analyses.runner import Analysis, Common, arguments_of, checked
from phaselens.contract.adapting import as_phase_model
from phaselens.contract.protocol import is_black_box
from phaselens.errors import InputError
from phaselens.planning.checkpoint_report import ModelPlan
from phaselens.planning.planned_items import plan_items
from phaselens.planning.run_plan import Plan, plan_run
from phaselens.runtime.request_plan import RequestPlan, plan_requests

SERVED_OPTIONS = ("prefill_tokens_per_s", "sample")  # plan_requests' own keywords (a served model's plan)


PACKAGES = ("phaselens.analyses", "phaselens.repair")  # where analyses live (repair_table with phase repair)


def analysis_modules() -> list[ModuleType]:
    """Every module of the packages that hold analyses (:data:`PACKAGES`), imported: the one place analyses are
    discovered (:func:`analyses`, :func:`public_analyses`, and the tests that walk every analysis)."""
    return [importlib.import_module(f"{package}.{info.name}") for package in PACKAGES
            for info in pkgutil.iter_modules(importlib.import_module(package).__path__)]


def analyses() -> dict[str, type[Analysis]]:
    """Every analysis by its public name (``specialization_map`` -> ``Map``): the subclasses of
    :class:`~phaselens.analyses.runner.Analysis` that the modules of :data:`PACKAGES` define."""
    analysis_modules()
    return dict(sorted((cls.name, cls) for cls in _subclasses()
                       if cls.__module__.startswith(tuple(f"{p}." for p in PACKAGES))
                       and isinstance(getattr(cls, "name", None), str)))


def public_analyses() -> dict[str, Callable[..., Any]]:
    """Every analysis's public function by name (``"ablate"`` -> ``phaselens.ablate``), in :func:`analyses`'s
    order: the functions a notebook calls, each of one signature style (docs/api.md, "One design")."""
    return {name: getattr(importlib.import_module(cls.__module__), name) for name, cls in analyses().items()}


def _subclasses() -> list[type[Analysis]]:
    out, todo = [], list(Analysis.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        out.append(cls)
    return out


def resolve(analysis: str | Callable[..., Any]) -> tuple[str, Callable[..., Any], type[Analysis]]:
    """``(name, public function, Analysis subclass)`` of an analysis given by name (one of phaselens') or as its
    public function (phaselens' or your own: the subclass whose ``name`` is the function's, in its module)."""
    name = analysis if isinstance(analysis, str) else getattr(analysis, "__name__", None)
    known = analyses()
    if callable(analysis) and name not in known:
        own = [c for c in _subclasses() if getattr(c, "name", None) == name and c.__module__ == analysis.__module__]
        if own:
            return str(name), analysis, own[-1]
    if name not in known:
        raise InputError(f"phaselens.plan: {analysis!r} is not an analysis; give one of {', '.join(sorted(known))} "
                         "(its name, or the function itself, e.g. phaselens.plan(model, phaselens.evaluate)).")
    return name, public_analyses()[name], known[name]


def plan(model: Any, analysis: str | Callable[..., Any], task: Any = None, **options: Any) -> Plan | ModelPlan | RequestPlan:
    """What ``analysis(model, task, **options)`` would cost, without running it (see the module docstring).

    Example:
        >>> p = phaselens.plan(phaselens.load("zoo:w4s4"), "specialization_map", n_per_residue=32)  # doctest: +SKIP
        >>> p.forwards, p.memory_bytes  # doctest: +SKIP
    """
    if isinstance(model, str | os.PathLike):
        return _plan_checkpoint(str(model), analysis, task, options)
    name, fn, cls = resolve(analysis)
    served = {k: options.pop(k) for k in SERVED_OPTIONS if k in options}
    model = as_phase_model(model, stride=options.get("stride"))  # as the analysis's @public would
    signature = inspect.signature(fn)
    try:
        bound = signature.bind(model, **options, task=task)
    except TypeError as err:
        raise InputError(f"phaselens.plan(model, {name!r}, ...): {err}; the options are {name}'s own "
                         f"({', '.join(p for p in signature.parameters if p not in ('model', 'task'))}).") from None
    arguments = arguments_of(fn, dict(bound.arguments))
    common = Common.of(arguments)
    checked_analysis = checked(cls.from_arguments(arguments), model, common)
    task, spec, items = plan_items(model, task, n_per_residue=common.n_per_residue, residues=common.residues,
                                   phase=common.phase, seed=common.seed, stride=common.stride)
    units = checked_analysis.units(model, items, common)
    if is_black_box(model):
        if served.get("sample") is None:
            served.pop("sample", None)
        return plan_requests(task, spec, n_per_residue=common.n_per_residue, residues=common.residues,
                             seed=common.seed, copies=units.copies, model=model.name, **served)
    if served:
        raise InputError(f"{', '.join(served)} price a served model's requests; {model.name} runs in this process.")
    return plan_run(model, name, units, items, batch_size=common.batch_size)


def _plan_checkpoint(source: str, analysis: Any, task: Any, options: dict[str, Any]) -> ModelPlan:
    """A checkpoint directory's :class:`ModelPlan` (``specialization_map`` only: its per-head map is priced)."""
    from phaselens.planning.checkpoint_plan import plan_model

    name, _, _ = resolve(analysis)
    if name != "specialization_map" or task is not None:
        raise InputError(f"a checkpoint ({source}) is planned from its config.json for a forward and a per-head "
                         f"map (specialization_map), not {name}{' on a task' if task is not None else ''}; load "
                         "the model (phaselens.load) and plan it: phaselens.plan(model, "
                         f"{name!r}, task, ...).")
    return plan_model(source, **options)


__all__ = ["PACKAGES", "analyses", "analysis_modules", "plan", "public_analyses", "resolve"]
