"""Hook contexts for models built on TransformerLens's ``HookedRootModule``.

TransformerLens calls a hook as ``fn(tensor, hook=hook_point)``. phaselens's models pass a
:class:`~phaselens.contract.protocol.HookContext` instead: the same ``name`` and ``layer()`` (and every other
attribute of the hook point, read through), plus where the call sits (``query_start``, ``first_entry``) and
what a wrapper announced (``row_shift``). Hooks added through ``hooks`` / ``run_with_hooks`` /
``run_with_cache`` get it; a hook added directly with ``HookPoint.add_hook`` gets the bare hook point.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from phaselens.contract.protocol import hook_context, hook_pairs

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


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit() else None


class ContextHooks:
    """Mixin for a ``HookedRootModule``: hook functions receive a :class:`~phaselens.contract.protocol.HookContext`.

    The model supplies ``phase_specs`` (for the first new entry of compressor hooks).
    """

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
            return fn(tensor, hook=self._context(hook))

        call.__wrapped__ = fn  # type: ignore[attr-defined]
        return call

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Any = (), bwd_hooks: Any = (), reset_hooks_end: bool = True,
              clear_contexts: bool = False) -> Iterator[Any]:
        """TransformerLens's ``hooks`` context (hooks removed in ``finally``), with hook contexts."""
        fwd = [(self._check_name(name), self._with_context(fn)) for name, fn in hook_pairs(fwd_hooks)]
        bwd = [(self._check_name(name), self._with_context(fn)) for name, fn in hook_pairs(bwd_hooks)]
        with super().hooks(fwd, bwd, reset_hooks_end, clear_contexts) as model:  # type: ignore[misc]
            yield model


    def _check_name(self, name: Any) -> Any:
        if not isinstance(name, str) or name in self.hook_dict:  # type: ignore[attr-defined]
            return name
        from phaselens.contract.hooknames import explain_missing
        from phaselens.core.errors import HookNameError

        raise HookNameError(explain_missing(name, self.hook_dict))  # type: ignore[attr-defined]
