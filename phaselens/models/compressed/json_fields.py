"""Frozen dataclass configs read from JSON: unknown and missing keys refused, each value checked against its
field's type before anything is built from it (:func:`fields_from_json`), and the checks that the configs'
``__post_init__`` share (every field's type, :func:`check_types`; a finite number, :func:`check_number`). Every error is a :class:`~phaselens.errors.ConfigError`
saying which field was wrong and what it must be."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from phaselens.errors import ConfigError


def check_keys(cls: type, data: Any) -> None:
    """``data`` must be a dict with every required field of ``cls`` and no unknown one."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {cls.__name__} must be a JSON object (dict), got {type(data).__name__} {data!r:.80}.")
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s) {unknown}; known keys are {sorted(known)}. "
            "Was this written by a newer phaselens?"
        )
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"{cls.__name__} is missing required key(s) {missing}; add them (see {cls.__name__}'s fields).")


def fields_from_json(cls: type, data: Any) -> dict[str, Any]:
    """``data`` (parsed JSON) checked against ``cls``'s field types before anything is built from it: keys as
    :func:`check_keys`, then each value's JSON type (a number for a float, whole numbers for ints, ...).
    Returns a copy with JSON numbers made floats where a float is meant, lists tuples, and JSON objects the
    dataclass their field holds (read the same way)."""
    check_keys(cls, data)
    hints = _hints(cls)
    out = dict(data)
    for name, value in data.items():
        tp = hints[name]
        if not json_fits(value, tp):
            raise ConfigError(f"{cls.__name__}.{name} must be {describe_type(tp)}, got {value!r:.80}; fix the config.")
        if float in type_options(tp) and isinstance(value, int) and not isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, list):  # only a tuple field takes a list (json_fits)
            out[name] = tuple(value)
        elif isinstance(value, dict):  # only a dataclass field takes an object (json_fits)
            nested = next(opt for opt in type_options(tp) if dataclasses.is_dataclass(opt))
            out[name] = nested(**fields_from_json(nested, value))
    return out


@functools.cache  # annotations are evaluated once per config class, not at every construction
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(config: Any) -> None:
    """Every field of the frozen dataclass ``config`` against its annotation (as :func:`json_fits` reads it, a
    nested config its own instance, never a dict): what the configs' ``__post_init__`` check first."""
    for f in dataclasses.fields(config):
        value, tp = getattr(config, f.name), _hints(type(config))[f.name]
        if not json_fits(value, tp, json=False):
            raise ConfigError(f"{type(config).__name__}.{f.name} must be {describe_type(tp)}, got {value!r:.80}.")


def type_options(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def json_fits(value: Any, tp: Any, *, json: bool = True) -> bool:
    """Whether ``value`` is one of ``tp``'s types (``json``: as parsed JSON holds it, a dataclass as a dict)."""
    for opt in type_options(tp):
        origin = typing.get_origin(opt)
        if opt is type(None) and value is None:
            return True
        if opt is bool and isinstance(value, bool):
            return True
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if opt is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if opt is str and isinstance(value, str):
            return True
        if origin is typing.Literal and any(value == a and type(value) is type(a) for a in typing.get_args(opt)):
            return True
        if origin is tuple and isinstance(value, list | tuple) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            return True
        if dataclasses.is_dataclass(opt) and isinstance(value, dict | opt if json else opt):
            return True
    return False


def describe_type(tp: Any) -> str:
    names = []
    for opt in type_options(tp):
        if opt is type(None):
            names.append("null")
        elif typing.get_origin(opt) is typing.Literal:
            names.append(" or ".join(repr(a) for a in typing.get_args(opt)))
        elif typing.get_origin(opt) is tuple:
            names.append("a list of ints")
        elif dataclasses.is_dataclass(opt):
            names.append(f"a {opt.__name__} (a JSON object)")
        else:
            other = f"a {opt.__module__}.{opt.__qualname__}" if isinstance(opt, type) else str(opt)  # torch.device
            names.append({bool: "true or false", int: "an int", float: "a number", str: "a string"}.get(opt, other))
    return " or ".join(names)


def check_number(owner: str, name: str, value: Any, *, positive: bool = True) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise ConfigError(f"{owner}.{name} must be a finite{' positive' if positive else ''} number, got {value!r}.")


__all__ = ["check_keys", "check_number", "check_types", "describe_type", "fields_from_json", "json_fits", "type_options"]
