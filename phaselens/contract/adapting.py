"""Objects phaselens did not build, as models: :func:`as_phase_model`, which every analysis applies to its model
argument once.

A user may hold a transformers model, an nnsight envoy or a TransformerLens ``TransformerBridge``. Analyses may
not import the model kinds that adapt them (analyses and models meet only in the contract), so the adapters
are **registered** here, as ``"module:function"`` import paths resolved on first use, by the package's
composition root (``phaselens/__init__.py`` registers ``phaselens.models.objects:adapt_object``). Importing this
module imports nothing heavy.

An adapter is ``fn(obj, *, stride=None) -> model | None``: ``None`` when ``obj`` is not something it adapts; a
:class:`~phaselens.errors.PhaseLensError` naming the route that works when it is, but cannot be analysed
as given (a model without compression and no ``stride``, say).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

_ADAPTERS: list[str] = []
_RUN_LOADERS: list[str] = []


def register_adapter(path: str) -> None:
    """Add the adapter at ``"module:function"`` (idempotent; adapters are tried in registration order)."""
    if ":" not in path:
        raise ValueError(f"an adapter is registered as 'module:function', got {path!r}.")
    if path not in _ADAPTERS:
        _ADAPTERS.append(path)


def is_phase_model(obj: Any) -> bool:
    """Whether ``obj`` already is a phaselens model (``dims``, ``identity()`` and a forward)."""
    return callable(obj) and callable(getattr(obj, "identity", None)) and hasattr(obj, "dims")


def as_phase_model(obj: Any, *, stride: int | None = None) -> Any:
    """``obj`` as a phaselens model: itself when it is one (or a name, a path or ``None``, which
    :func:`~phaselens.contract.protocol.check_model` refuses with its own message), else what the first
    registered adapter makes of it; unchanged when no adapter takes it.

    Args:
        obj: the model argument of an analysis.
        stride: the analysis's ``stride=``: the geometry a model without compression is analysed at.
    """
    if obj is None or isinstance(obj, str | bytes | os.PathLike):
        return obj
    if is_phase_model(obj):
        return at_stride(obj, stride)
    for path in _ADAPTERS:
        module, _, name = path.partition(":")
        out = getattr(importlib.import_module(module), name)(obj, stride=stride)
        if out is not None:
            return out
    return obj


def at_stride(model: Any, stride: Any) -> Any:
    """A phaselens ``model`` as an analysis's ``stride=`` reads it (docs/concepts.md, "Strides: one rule"): a
    model without compression that can be read at another geometry (``with_geometry``, the causal-LM adapter) is
    adapted anew at ``stride``, so everything the analysis derives from the model (calibration items, metadata)
    is at that stride; any other model is returned as it is (the analysis checks ``stride`` against its
    compression and reads phases at it)."""
    if stride is None:
        return model
    restride = getattr(model, "with_geometry", None)
    return restride(stride) if callable(restride) else model


def register_run_loader(path: str) -> None:
    """Register the loader of a training run's committed steps (``"module:function"``, ``fn(path) -> model``) that
    ``phaselens.load(run or step folder)`` uses: training sits above the models layer, so the package's
    composition root wires it in (``phaselens.train.family.checkpoints:load_checkpoint``)."""
    if ":" not in path:
        raise ValueError(f"a loader is registered as 'module:function', got {path!r}.")
    if path not in _RUN_LOADERS:
        _RUN_LOADERS.append(path)


def run_loader() -> Any:
    """The registered training-step loader (imported on first use), or ``None``."""
    if not _RUN_LOADERS:
        return None
    module, _, name = _RUN_LOADERS[0].partition(":")
    return getattr(importlib.import_module(module), name)
