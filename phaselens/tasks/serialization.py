"""JSON round-trips for tasks: ``to_dict`` / ``from_dict`` and the ``task_from_dict`` registry.

A task serialises to ``{"kind": <name>, <field>: <value>, ...}`` with JSON-native values (tuples become
lists). Fields marked ``field(metadata={"serialize": False})`` (a tokenizer, say) are left out and must be
passed back as keyword arguments: ``task_from_dict(d, tokenizer=tok)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from phaselens.errors import TaskError

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound="SerializableTask")


def register_task(cls: type[T]) -> type[T]:
    """Class decorator: make ``cls`` loadable by :func:`task_from_dict` under ``cls.kind``."""
    kind = cls.kind
    if kind in _REGISTRY and _REGISTRY[kind] is not cls:
        raise TaskError(f"task kind {kind!r} is already registered by {_REGISTRY[kind].__name__}.")
    _REGISTRY[kind] = cls
    return cls


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


class SerializableTask:
    """Mixin for frozen task dataclasses: JSON-safe ``to_dict`` and a validating ``from_dict``."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., **fields}`` with JSON-native values; runtime-only fields are omitted."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata.get("serialize", True):
                out[f.name] = _jsonable(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls: type[T], d: Mapping[str, Any], **runtime: Any) -> T:
        """Rebuild a task from :meth:`to_dict` output; ``runtime`` supplies non-serialised fields."""
        d = dict(d)
        kind = d.pop("kind", cls.kind)
        if kind != cls.kind:
            raise TaskError(f"{cls.__name__}.from_dict got kind {kind!r}; expected {cls.kind!r}.")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise TaskError(f"unknown {cls.kind} field(s) {unknown}; known: {sorted(fields)}.")
        for name, value in runtime.items():
            if name not in fields or fields[name].metadata.get("serialize", True):
                raise TaskError(f"{name!r} is not a runtime argument of {cls.__name__}.")
            d[name] = value
        missing = [
            n
            for n, f in fields.items()
            if n not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            hint = (
                " (pass them as keyword arguments)"
                if any(not fields[n].metadata.get("serialize", True) for n in missing)
                else ""
            )
            raise TaskError(f"{cls.__name__} needs {missing}{hint}.")
        return cls(**{k: (v if k in runtime else _from_json(v)) for k, v in d.items()})


def task_from_dict(d: Mapping[str, Any], **runtime: Any) -> Any:
    """Rebuild any registered task from ``task.to_dict()``; e.g. ``task_from_dict(d, tokenizer=tok)``."""
    if not isinstance(d, Mapping) or "kind" not in d:
        raise TaskError(f"a task dict needs a 'kind' key (one of {sorted(_REGISTRY)}), got {d!r:.200}.")
    kind = d["kind"]
    if kind not in _REGISTRY:
        raise TaskError(f"unknown task kind {kind!r}; known kinds: {sorted(_REGISTRY)}.")
    return _REGISTRY[kind].from_dict(d, **runtime)


def registered_kinds() -> list[str]:
    return sorted(_REGISTRY)
