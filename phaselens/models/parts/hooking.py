"""Hook contexts for models built on TransformerLens's ``HookedRootModule``.

TransformerLens calls a hook as ``fn(tensor, hook=hook_point)``. phaselens's models pass a
:class:`~phaselens.contract.protocol.HookContext` instead: the same ``name`` and ``layer()`` (and every other
attribute of the hook point, read through), plus where the call sits (``query_start``, ``first_entry``) and
what a wrapper announced (``row_shift``). Hooks added through ``hooks`` / ``run_with_hooks`` /
``run_with_cache`` get it; a hook added directly with ``HookPoint.add_hook`` gets the bare hook point.

What a hook returns replaces the value at its hook point, so it is checked there (:func:`check_hook_return`):
``None``, or a tensor of exactly the given shape, dtype and device; anything else is an
:class:`~phaselens.core.errors.InputError` naming the hook point, what was expected and what came back (not a
broadcast, a silent dtype promotion or a raw error three layers later). Hooks never outlive a failed call:
the ``hooks`` context removes its hooks on an error even with ``reset_hooks_end=False``, and a hook added with
``model.add_hook`` that returns a wrong value is removed before the error is raised.
"""

from __future__ import annotations

import contextlib
import contextvars
import reprlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from phaselens.contract.protocol import hook_context, hook_pairs
from phaselens.core.errors import InputError
from phaselens.models.parts.tl_habits import PhaseCache, TLHabits, check_names_filter

_START: contextvars.ContextVar[int] = contextvars.ContextVar("phaselens_query_start", default=0)
_SILENT: contextvars.ContextVar[bool] = contextvars.ContextVar("phaselens_hooks_silent", default=False)
_FIRST_ENTRY_SITES = ("hook_gate", "hook_payload", "hook_entry")


@contextlib.contextmanager
def query_start(slot: int) -> Iterator[None]:
    """Inside the block, hooks see ``query_start = slot`` (the cache slot of row 0 of the call)."""
    token = _START.set(int(slot))
    try:
        yield
    finally:
        _START.reset(token)


@contextlib.contextmanager
def silent_hooks() -> Iterator[None]:
    """Inside the block, hooks added through ``hooks`` / ``run_with_hooks`` / ``run_with_cache`` do not run (a
    chunked prefill's prefix pieces: only the query piece is hooked, as in the DeepSeek-V4 adapter)."""
    token = _SILENT.set(True)
    try:
        yield
    finally:
        _SILENT.reset(token)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype} on {value.device}"
    shape = getattr(value, "shape", None)  # numpy arrays and the like
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{reprlib.repr(value)[:80]} (of type {type(value).__name__})"  # bounded, whatever the object


def check_hook_return(name: str, given: Tensor, out: Any) -> None:
    """``out``, what the hook on ``name`` returned for ``given``, must be ``None`` (the hook only read) or a
    tensor of ``given``'s shape, dtype and device (its replacement); else an :class:`InputError` naming both."""
    if out is None or out is given:
        return
    if isinstance(out, Tensor) and out.shape == given.shape and out.dtype == given.dtype \
            and out.device == given.device:
        return
    raise InputError(
        f"the hook on {name} returned {_describe(out)}; a hook returns None (to read the value) or a tensor of "
        f"shape {tuple(given.shape)}, dtype {given.dtype} on {given.device} (to replace it): e.g. edit a copy "
        "and return it, cast with .to(value.dtype), or return None."
    )


def read_only(point: Any, value: Tensor, why: str) -> None:
    """Call the hook point ``point`` on ``value``, a reading the model does not compute with: a hook (or an
    nnsight edit) that returns a different tensor is an :class:`InputError` (``why``: what to edit instead),
    never an edit that is silently ignored."""
    out = point(value)
    if out is not value and not (isinstance(out, Tensor) and out.shape == value.shape and torch.equal(out, value)):
        raise InputError(f"{point.name} is read-only: {why}")


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit() else None


class ContextHooks(TLHabits):
    """Mixin for a ``HookedRootModule``: hook functions receive a :class:`~phaselens.contract.protocol.HookContext`,
    and ``run_with_cache`` returns a :class:`~phaselens.models.parts.tl_habits.PhaseCache`.

    The model supplies ``phase_specs`` (for the first new entry of compressor hooks).
    """

    def run_with_cache(self, *model_args: Any, names_filter: Any = None, **kwargs: Any) -> tuple[Any, PhaseCache]:
        """TransformerLens's ``run_with_cache``: ``(output, cache)``, the cache a TransformerLens
        ``ActivationCache`` (:class:`~phaselens.models.parts.tl_habits.PhaseCache`). A ``names_filter`` that selects no
        hook is a :class:`~phaselens.core.errors.HookNameError` naming what it wanted."""
        names = check_names_filter(list(self.hook_dict), names_filter)  # type: ignore[attr-defined]
        out, store = super().run_with_cache(*model_args, names_filter=names, **kwargs)  # type: ignore[misc]
        return out, PhaseCache(store, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def _context(self, point: Any) -> Any:
        name = point.name
        layer = _layer_of(name)
        start = _START.get()
        first = None
        if layer is not None and name.rsplit(".", 1)[-1].startswith(_FIRST_ENTRY_SITES):
            spec = self.phase_specs[layer]  # type: ignore[attr-defined]
            first = start // spec.stride if spec is not None else None
        return hook_context(point, name, layer, query_start=start, first_entry=first)

    def _with_context(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: Any, hook: Any) -> Any:
            if _SILENT.get():
                return None
            out = fn(tensor, hook=self._context(hook))
            check_hook_return(hook.name, tensor, out)
            return out

        call.__wrapped__ = fn  # type: ignore[attr-defined]
        return call

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Any = (), bwd_hooks: Any = (), reset_hooks_end: bool = True,
              clear_contexts: bool = False) -> Iterator[Any]:
        """TransformerLens's ``hooks`` context (hooks removed in ``finally``), with hook contexts and checked
        returns; on an error its hooks are removed even with ``reset_hooks_end=False``."""
        fwd = [(self._check_name(name), self._with_context(fn)) for name, fn in hook_pairs(fwd_hooks)]
        bwd = [(self._check_name(name), self._with_context(fn)) for name, fn in hook_pairs(bwd_hooks)]
        with super().hooks(fwd, bwd, reset_hooks_end, clear_contexts) as model:  # type: ignore[misc]
            try:
                yield model
            except BaseException:
                if not reset_hooks_end:  # a failed call leaves no hooks behind
                    self.reset_hooks(clear_contexts, including_permanent=False,  # type: ignore[attr-defined]
                                     level=self.context_level)  # type: ignore[attr-defined]
                raise

    def check_and_add_hook(self, hook_point: Any, hook_point_name: str, hook: Callable[..., Any],
                           dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                           prepend: bool = False) -> None:
        """``model.add_hook``'s way in (TransformerLens): the hook's return is checked, and a hook that returns
        a wrong value is removed from its hook point before the :class:`InputError` is raised."""
        user = hook

        def checked(tensor: Any, hook: Any) -> Any:
            out = user(tensor, hook=hook)
            try:
                check_hook_return(hook_point_name, tensor, out)
            except InputError:
                for handle in [h for h in [*hook_point.fwd_hooks, *hook_point.bwd_hooks]
                               if getattr(h, "user_hook", None) is checked]:
                    handle.hook.remove()
                    for store in (hook_point.fwd_hooks, hook_point.bwd_hooks):
                        if handle in store:
                            store.remove(handle)
                raise
            return out

        checked.__wrapped__ = user  # type: ignore[attr-defined]
        super().check_and_add_hook(hook_point, hook_point_name, checked, dir=dir,  # type: ignore[misc]
                                   is_permanent=is_permanent, level=level, prepend=prepend)


    def _check_name(self, name: Any) -> Any:
        if not isinstance(name, str) or name in self.hook_dict:  # type: ignore[attr-defined]
            return name
        from phaselens.contract.hooknames import explain_missing
        from phaselens.core.errors import HookNameError

        raise HookNameError(explain_missing(name, self.hook_dict))  # type: ignore[attr-defined]
