"""The hook machinery of every model kind, over the one dispatch of :mod:`.hook_sites`.

* :class:`ContextHooks`, for a kind built on TransformerLens's ``HookedRootModule`` (the zoo, DeepSeek-V4.1):
  TransformerLens calls a hook as ``fn(tensor, hook=hook_point)``; phaselens passes a
  :class:`~phaselens.contract.protocol.HookContext` instead (the same ``name`` and ``layer()``, every attribute
  of the hook point read through, plus where the call sits: ``query_start``, ``first_entry``, and what a wrapper
  announced: ``row_shift``). The kind's table (``hook_sites``) marks its read-only hook points.
* :class:`HookedAdapter`, for a kind that hooks a model it did not build (the DeepSeek-V4 and causal-LM
  adapters): ``hooks`` contexts stack resolved hooks that the kind's forward installs as torch hooks for one call.

Hooks added through ``hooks`` / ``run_with_hooks`` / ``run_with_cache`` (and ``model.add_hook``) are checked by
:func:`~.hook_sites.check_hook_return` on every kind. Hooks never outlive a failed call: a ``hooks`` context
removes its hooks on an error even with ``reset_hooks_end=False``, and a hook added with ``model.add_hook`` that
returns a wrong value is removed before the error is raised.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from phaselens.contract.hooknames import HookDict, explain_missing
from phaselens.contract.protocol import hook_context, hook_pairs
from phaselens.errors import HookNameError, InputError
from phaselens.models.parts.hook_sites import call_hooks, check_hook_return
from phaselens.models.parts.tl_habits import PhaseCache, TLHabits, check_names_filter, tokenizer_from_dir

_START: contextvars.ContextVar[int] = contextvars.ContextVar("phaselens_query_start", default=0)
_SILENT: contextvars.ContextVar[bool] = contextvars.ContextVar("phaselens_hooks_silent", default=False)
_FIRST_ENTRY_SITES = ("hook_gate", "hook_payload", "hook_entry")


@contextlib.contextmanager
def _set(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def query_start(slot: int) -> contextlib.AbstractContextManager[None]:
    """Inside the block, hooks see ``query_start = slot`` (the cache slot of row 0 of the call)."""
    return _set(_START, int(slot))


def silent_hooks() -> contextlib.AbstractContextManager[None]:
    """Inside the block, hooks added through ``hooks`` / ``run_with_hooks`` / ``run_with_cache`` do not run (a
    chunked prefill's prefix pieces: only the query piece is hooked, as in the DeepSeek-V4 adapter)."""
    return _set(_SILENT, True)


def read_only(point: Any, value: Tensor) -> None:
    """Call the read-only hook point ``point`` on ``value`` (a reading the model does not compute with): an edit
    there, by a hook or by nnsight, is an :class:`InputError` saying what to edit instead, never ignored."""
    check_hook_return(point.name, value, point(value), point.read_only)


class ContextHooks(TLHabits):
    """Mixin for a ``HookedRootModule``: hook functions receive a :class:`~phaselens.contract.protocol.HookContext`,
    their returns are checked, and ``run_with_cache`` returns a :class:`~phaselens.models.parts.tl_habits.PhaseCache`.

    The model supplies ``hook_sites`` (its table's hook points: the read-only ones are marked from it) and
    ``phase_specs`` (for the first new entry of compressor hooks).
    """

    def setup(self) -> None:
        """TransformerLens's name tables, with lookups of missing names explained (``HookNameError``), and the
        read-only hook points marked from the kind's table."""
        super().setup()  # type: ignore[misc]
        self.mod_dict = HookDict(self.mod_dict)
        self.hook_dict = HookDict(self.hook_dict)
        for name, point in self.hook_dict.items():
            site = self.hook_sites.get(name)  # type: ignore[attr-defined]
            point.read_only = "" if site is None else site.read_only

    def run_with_cache(self, *model_args: Any, names_filter: Any = None, **kwargs: Any) -> tuple[Any, PhaseCache]:
        """TransformerLens's ``run_with_cache``: ``(output, cache)``, the cache a TransformerLens
        ``ActivationCache`` (:class:`~phaselens.models.parts.tl_habits.PhaseCache`). A ``names_filter`` that selects
        no hook is a :class:`~phaselens.errors.HookNameError` naming what it wanted."""
        names = check_names_filter(list(self.hook_dict), names_filter)  # type: ignore[attr-defined]
        out, store = super().run_with_cache(*model_args, names_filter=names, **kwargs)  # type: ignore[misc]
        return out, PhaseCache(store, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def _context(self, point: Any) -> Any:
        name = point.name
        parts = name.split(".")
        layer = int(parts[1]) if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit() else None
        start = _START.get()
        first = None
        if layer is not None and name.rsplit(".", 1)[-1].startswith(_FIRST_ENTRY_SITES):
            stride = self._entry_stride(name, layer)
            first = start // stride if stride is not None else None
        return hook_context(point, name, layer, query_start=start, first_entry=first)

    def _entry_stride(self, name: str, layer: int) -> int | None:
        """Tokens per entry that the compressor hook ``name`` of ``layer`` counts (``None``: it counts none)."""
        spec = self.phase_specs[layer]  # type: ignore[attr-defined]
        return None if spec is None else spec.stride

    def _with_context(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: Any, hook: Any) -> Any:
            if _SILENT.get():
                return None
            out, replaced = call_hooks(hook, [fn], tensor, self._context(hook))
            return out if replaced else None

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
            try:
                out, replaced = call_hooks(hook_point, [user], tensor, hook)
            except InputError:
                for handle in [h for h in [*hook_point.fwd_hooks, *hook_point.bwd_hooks]
                               if getattr(h, "user_hook", None) is checked]:
                    handle.hook.remove()
                    for store in (hook_point.fwd_hooks, hook_point.bwd_hooks):
                        if handle in store:
                            store.remove(handle)
                raise
            return out if replaced else None

        checked.__wrapped__ = user  # type: ignore[attr-defined]
        super().check_and_add_hook(hook_point, hook_point_name, checked, dir=dir,  # type: ignore[misc]
                                   is_permanent=is_permanent, level=level, prepend=prepend)

    def _check_name(self, name: Any) -> Any:
        if not isinstance(name, str) or name in self.hook_dict:  # type: ignore[attr-defined]
            return name
        raise HookNameError(explain_missing(name, self.hook_dict))  # type: ignore[attr-defined]


class HookedAdapter(TLHabits):
    """The hook machinery of a kind that hooks a model it did not build (the DeepSeek-V4 and causal-LM adapters):
    hook names are the keys of ``self._points`` (its table's hook points); ``hooks`` contexts stack their resolved
    hooks on ``self._active`` (a list the kind creates), which its forward reads through :meth:`_merged_hooks`
    and runs through :func:`~.hook_sites.call_hooks`. Also TransformerLens's ``run_with_hooks`` and
    ``run_with_cache``.

    A kind overrides :meth:`_missing_hook` to say what its names are. Its tokenizer is found in the directory of
    the wrapped transformers model (``self.model``), where it was loaded from.
    """

    _points: dict[str, Any]
    _active: list[tuple[object, dict[str, list[Any]]]]
    model: Any

    def _find_tokenizer(self) -> Any:
        return tokenizer_from_dir(getattr(self.model.config, "_name_or_path", None))

    @property
    def hook_sites(self) -> dict[str, Any]:
        """Every hook name with its :class:`~phaselens.contract.hooknames.HookPoint` (shape, read-only or not), in
        execution order."""
        return dict(self._points)

    @property
    def hook_dict(self) -> dict[str, Any]:
        """:attr:`hook_sites` whose missing names raise a :class:`~phaselens.errors.HookNameError` that says
        what exists instead."""
        return _AdapterHookDict(self)

    def _missing_hook(self, name: str) -> None:
        """Raise the :class:`HookNameError` of a name the model lacks."""
        raise HookNameError(explain_missing(name, self._points))

    def _hooks_active(self) -> bool:
        """Whether a ``hooks`` context is open (the query engine then refuses to run)."""
        return bool(self._active)

    def select_hooks(self, target: Any) -> list[str]:
        """Names selected by a name, a list of names, or a predicate (``None`` selects every name)."""
        if target is None:
            return list(self._points)
        if isinstance(target, str):
            if target not in self._points:
                self._missing_hook(target)
            return [target]
        if callable(target):
            return [name for name in self._points if target(name)]
        if isinstance(target, Iterable):
            return [name for item in target for name in self.select_hooks(item)]
        raise InputError(f"a hook target is a name, a list of names or a predicate, got {target!r}.")

    def resolve_hooks(self, fwd_hooks: Any) -> dict[str, list[Any]]:
        """``(name_or_filter, fn)`` pairs as ``{name: [fn, ...]}`` in call order (the ``hooks`` context and the
        V4 engine's passes read them so)."""
        out: dict[str, list[Any]] = {}
        for target, fn in hook_pairs(fwd_hooks):
            for name in self.select_hooks(target):
                out.setdefault(name, []).append(fn)
        return out

    def _merged_hooks(self) -> dict[str, list[Any]]:
        """The hooks of every open ``hooks`` context, by name, in entry order."""
        merged: dict[str, list[Any]] = {}
        for _, resolved in self._active:
            for name, fns in resolved.items():
                merged.setdefault(name, []).extend(fns)
        return merged

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[Any, Any]] = (), bwd_hooks: Iterable[Any] = (),
              reset_hooks_end: bool = True) -> Iterator[Any]:
        """Apply ``fwd_hooks`` to every forward inside the block; removed in ``finally`` whatever raises.

        ``fwd_hooks``: ``(name_or_filter, fn)`` pairs; a filter is a name, a list of names or a predicate on
        names. ``fn(tensor, *, hook)`` may return a replacement (read-only sites refuse one). Contexts nest;
        hooks run in entry order. Torch hooks exist on the model only during each forward.
        """
        if list(bwd_hooks):
            raise InputError(f"{type(self).__name__} has no backward hooks; take gradients of hooked tensors instead.")
        if not reset_hooks_end:
            raise InputError("reset_hooks_end=False is not supported: the adapter never leaves hooks on the model.")
        token = object()
        self._active.append((token, self.resolve_hooks(fwd_hooks)))
        try:
            yield self
        finally:
            self._active = [item for item in self._active if item[0] is not token]

    def run_with_hooks(self, tokens: Tensor, *, fwd_hooks: Iterable[tuple[Any, Any]] = (),
                       **forward_kwargs: Any) -> Tensor:
        """``adapter(tokens, **forward_kwargs)`` with ``fwd_hooks`` applied for that one call."""
        with self.hooks(fwd_hooks=fwd_hooks):
            return self(tokens, **forward_kwargs)  # type: ignore[operator]

    def run_with_cache(self, tokens: Tensor, *, names_filter: Any = None, device: torch.device | str | None = None,
                       **forward_kwargs: Any) -> tuple[Tensor, PhaseCache]:
        """``(logits, cache)``: a TransformerLens ``ActivationCache`` (:class:`PhaseCache`) of the names
        ``names_filter`` selects (all if ``None``: always filter in sweeps; a filter selecting none is a
        ``HookNameError``), detached copies moved to ``device`` if given. ``cache["pattern_entry", 1]`` and
        ``cache["blocks.1.attn.hook_z"]`` both work."""
        store: dict[str, Tensor] = {}

        def keep(tensor: Tensor, *, hook: Any) -> None:
            value = tensor.detach()
            store[hook.name] = value.to(device, copy=True) if device is not None else value.clone()

        names = check_names_filter(list(self._points), names_filter)
        logits = self.run_with_hooks(tokens, fwd_hooks=[(n, keep) for n in names], **forward_kwargs)
        return logits, PhaseCache(store, self, has_batch_dim=True)


class _AdapterHookDict(HookDict):
    """An adapter's hook points; a missing name raises the adapter's own explanation (:meth:`_missing_hook`)."""

    def __init__(self, adapter: HookedAdapter) -> None:
        super().__init__(adapter._points)
        self._adapter = adapter

    def __missing__(self, name: Any) -> Any:
        self._adapter._missing_hook(str(name))
