"""The closed set of types a result file may name, and the check of a file's fields against their declarations.

A saved result's skeleton names each frozen dataclass it holds by a short name (``"PhaseEval"``). Loading
looks the name up in :data:`TYPES`, a fixed table written here: nothing read from a file chooses a module, an
attribute or a callable. Before the type is called, the file's fields are checked against the type's declared
``__init__`` fields and their annotations: an unknown, missing or mistyped field is a
:class:`~phaselens.errors.ResultFileError` that names it. Saving refuses a dataclass outside the table, so
every file phaselens writes can be read back.

The table holds module names as data (as ``phaselens/__init__``'s export table does): each type's module is
imported only when a file names it, so ``import phaselens.results`` stays light.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
import typing
from typing import Any

import numpy as np
import pandas as pd

from phaselens.errors import InputError, ResultFileError

# short name -> the module that defines it (the only modules a load ever imports)
TYPES: dict[str, str] = {
    "PhaseAblation": "phaselens.results.ablation_effects",
    "PhaseAttribution": "phaselens.results.attribution_estimate",
    "PhaseGateCycling": "phaselens.results.gate_cycling",
    "PhaseEval": "phaselens.results.phase_eval",
    "PhaseMap": "phaselens.results.phase_map",
    "PhasePatch": "phaselens.results.patch_recovery",
    "PhaseRecording": "phaselens.results.entry_reads_writes",
    "PhaseRepairTable": "phaselens.results.repair_rules",
    "Head": "phaselens.core.heads",
    "Labelled": "phaselens.core.labelled",
    "PhaseBattery": "phaselens.stats.battery",
    "ItemBattery": "phaselens.stats.battery_items",
    "ContinuousResult": "phaselens.stats.continuous",
    "Effects": "phaselens.stats.effects",
    "GapInterval": "phaselens.stats.outcomes",
    "PermutationResult": "phaselens.stats.outcomes",
    "TestResult": "phaselens.stats.outcomes",
    "PeriodResult": "phaselens.stats.period",
    "HarmonicResult": "phaselens.stats.periodicity",
}


def name_of(obj: Any) -> str:
    """The registered name of the dataclass instance ``obj``; another class cannot be saved (InputError)."""
    cls = type(obj)
    if TYPES.get(cls.__qualname__) != cls.__module__:
        raise InputError(f"cannot save a {cls.__module__}.{cls.__qualname__} inside a result: only phaselens' "
                         f"result and value types are saved ({', '.join(sorted(TYPES))}); convert it to "
                         "plain values (dicts, lists, arrays, frames) first.")
    return cls.__qualname__


def resolve(name: Any) -> type:
    """The registered class ``name``; anything else is a :class:`ResultFileError`, raised before any import."""
    if not isinstance(name, str) or name not in TYPES:
        raise ResultFileError(f"the result file names the type {str(name)[:80]!r}, which is not one of phaselens' "
                              "result types; phaselens rebuilds only its own (a file naming another was not "
                              "written by phaselens, or was edited): do not load it.")
    cls = vars(importlib.import_module(TYPES[name])).get(name)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):  # a broken table, not a broken file
        raise AssertionError(f"registry entry {name} -> {TYPES[name]} is not a dataclass")
    return cls


@functools.cache  # annotations are evaluated once per type, not once per loaded object
def declared(cls: type) -> tuple[dict[str, Any], set[str]]:
    """``cls``'s ``__init__`` fields with their resolved annotations, and the names that have no default."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = {f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {f.name: hints.get(f.name, Any) for f in fields}, required


def check_fields(cls: type, values: dict[str, Any]) -> None:
    """Refuse (ResultFileError, naming the field) values that ``cls`` does not declare, lacks, or mistypes."""
    hints, required = declared(cls)
    unknown = sorted(set(values) - set(hints))
    missing = sorted(required - set(values))
    if unknown or missing:
        parts = ([f"unknown field(s) {', '.join(map(repr, unknown[:4]))}"] if unknown else []) + \
                ([f"missing field(s) {', '.join(map(repr, missing[:4]))}"] if missing else [])
        raise ResultFileError(f"the result file's {cls.__name__} has {' and '.join(parts)}; a {cls.__name__} "
                              f"declares {', '.join(hints)}. The file was edited or damaged: save the result again.")
    for name, value in values.items():
        if not conforms(value, hints[name]):
            raise ResultFileError(f"the result file's {cls.__name__}.{name} holds a {type(value).__name__}, "
                                  f"where a {cls.__name__} declares {_shown(hints[name])}. The file was edited or "
                                  "damaged: save the result again.")


def conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded ``value`` matches the annotation ``hint`` (containers element by element)."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(conforms(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is dict:
        k, v = args or (Any, Any)
        return isinstance(value, dict) and all(conforms(a, k) and conforms(b, v) for a, b in value.items())
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(x, args[0]) for x in value)
        return len(value) == len(args) and all(conforms(x, a) for x, a in zip(value, args))
    if origin is list:
        return isinstance(value, list) and all(conforms(x, (args or (Any,))[0]) for x in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (np.ndarray, pd.DataFrame) or isinstance(hint, type):
        return isinstance(value, hint)
    raise AssertionError(f"a result type declares {hint!r}, which the registry cannot check")


def _shown(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
