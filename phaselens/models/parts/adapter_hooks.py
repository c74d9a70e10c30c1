"""The torch hooks of the kinds that hook a model they did not build (the causal-LM and DeepSeek-V4 adapters),
for one forward: :class:`HookRun` (the forward's state; it runs every hook through the one dispatch of
:mod:`.hook_sites`), :func:`module_hook` (the torch hook of a site that is one module's input or output) and
:func:`remove_all` (every handle the forward registered, removed whatever raised).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from phaselens.contract.hooknames import HookPoint
from phaselens.contract.protocol import HookFn, hook_context
from phaselens.models.parts.hook_sites import call_hooks


@dataclass
class HookRun:
    """One hooked forward: the cache slot of its row 0, the names that fired, and the batch size (read from the
    token embedding where a kind needs it: GPT-2's position hook shows it)."""

    query_start: int = 0
    fired: set[str] = field(default_factory=set)
    batch: int = 1

    def hooks(self, point: HookPoint, fns: list[HookFn], tensor: Tensor, first_entry: int | None = None
              ) -> tuple[Tensor, bool]:
        """``fns`` run on ``tensor`` at ``point`` through the one dispatch: ``(tensor, replaced)``."""
        self.fired.add(point.name)
        ctx = hook_context(point, point.name, point.layer, query_start=self.query_start, first_entry=first_entry)
        return call_hooks(point, fns, tensor, ctx)


def module_hook(module: nn.Module, handle: str, get: Callable[[Any], Tensor],
                put: Callable[[Any, Tensor], Any] | None, run: Callable[[Tensor], Tensor]) -> Any:
    """Register the torch hook of a site that is ``module``'s ``"input"`` (its first argument, or
    ``hidden_states``) or ``"output"``: ``run(get(x))`` (the hooks on the site's view of ``x``) goes on in the
    model as ``put(x, value)`` (``put=None``: a read-only site, ``x`` goes on). Returns the handle.

    The model goes on with ``put(x, value)`` even when no hook replaced the value (a per-head view is a new
    tensor object), so that gradients with respect to the hooked tensor flow, as in TransformerLens."""
    def apply(x: Any) -> Any:
        value = run(get(x))
        return None if put is None else put(x, value)

    if handle == "output":
        return module.register_forward_hook(lambda _m, _args, out: apply(out))

    def pre(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        new = apply(args[0] if args else kwargs["hidden_states"])
        if new is None:
            return None
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

    return module.register_forward_pre_hook(pre, with_kwargs=True)


def remove_all(handles: list[Any]) -> None:
    """Remove every torch hook handle of ``handles`` (an ``ExitStack`` callback registered before the first)."""
    for handle in handles:
        handle.remove()
    handles.clear()
