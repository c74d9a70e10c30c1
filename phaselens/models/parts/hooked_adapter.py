"""The hook dispatch of the kinds that hook a model they did not build (the DeepSeek-V4 and causal-LM adapters):
:class:`HookedAdapter`, their ``hooks`` / ``run_with_hooks`` / ``run_with_cache`` written once.

Kinds built on TransformerLens's ``HookedRootModule`` (the zoo, DeepSeek-V4.1) keep TransformerLens's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from phaselens.contract.hooknames import explain_missing
from phaselens.contract.protocol import hook_pairs
from phaselens.core.errors import HookNameError, InputError
from phaselens.models.parts.tl_habits import PhaseCache, TLHabits, check_names_filter


class HookedAdapter(TLHabits):
    """The hook dispatch of a kind that hooks a model it did not build (the DeepSeek-V4 and causal-LM adapters):
    hook names are the keys of ``self._points``; ``hooks`` contexts stack their resolved hooks on
    ``self._active`` (a list the kind creates), which its forward reads through :meth:`_merged_hooks`. Also
    TransformerLens's ``run_with_hooks`` and ``run_with_cache``; kinds built on ``HookedRootModule`` keep
    TransformerLens's own.

    A kind overrides :meth:`_missing_hook` to say what its names are.
    """

    _points: dict[str, Any]
    _active: list[tuple[object, dict[str, list[Any]]]]

    def _missing_hook(self, name: str) -> None:
        """Raise the :class:`HookNameError` of a name the model lacks."""
        raise HookNameError(explain_missing(name, self._points))

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
        """``(name_or_filter, fn)`` pairs as ``{name: [fn, ...]}`` in call order."""
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

    @contextmanager
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
        """``(logits, cache)`` of an adapter kind (its hook names are the keys of ``self._points``): a
        TransformerLens ``ActivationCache`` (:class:`PhaseCache`) of the names ``names_filter`` selects (all if
        ``None``: always filter in sweeps; a filter selecting none is a ``HookNameError``), detached copies moved
        to ``device`` if given. ``cache["pattern_entry", 1]`` and ``cache["blocks.1.attn.hook_z"]`` both work."""
        store: dict[str, Tensor] = {}

        def keep(tensor: Tensor, *, hook: Any) -> None:
            value = tensor.detach()
            store[hook.name] = value.to(device, copy=True) if device is not None else value.clone()

        names = check_names_filter(list(self._points), names_filter)
        logits = self.run_with_hooks(tokens, fwd_hooks=[(n, keep) for n in names], **forward_kwargs)
        return logits, self.make_cache(store)
