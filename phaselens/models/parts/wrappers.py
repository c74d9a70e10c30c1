"""Model objects other libraries wrap: an nnsight envoy, a TransformerLens ``TransformerBridge``, and a
transformers model a bridge rewired in place.

* :func:`unwrap_object` takes whatever the user holds and returns the ``torch.nn.Module`` with the weights,
  and how it was found (``"module"``, ``"nnsight"``, ``"bridge"``);
* :func:`unbridged` undoes, in a **view**, what booting a TransformerLens bridge does to a transformers model:
  the bridge replaces every component in place (``model.model.layers[0]`` becomes a ``BlockBridge`` holding the
  original layer as ``_original_component``, and so on down to ``self_attn`` and the projections), so torch
  hooks on the original modules never fire and transformers' attention runs inside TransformerLens code. The
  view is a shallow copy of each container on the path with the original components put back: the same
  parameters and leaf modules (no weight is copied), nothing of the user's object changed.

Detected by the object's type (its module path), never by ``hasattr(x, "save")``: ``import nnsight`` mounts
``.save`` on every Python object.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from torch import nn

ORIGINAL = "_original_component"  # where a TransformerLens bridge component keeps the module it replaced


def _from(obj: Any, package: str) -> bool:
    return type(obj).__module__.split(".", 1)[0] == package


def is_bridge_component(module: Any) -> bool:
    """A TransformerLens component that replaced a transformers module in place."""
    return _from(module, "transformer_lens") and isinstance(getattr(module, "_modules", {}).get(ORIGINAL), nn.Module)


def bridged_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that a TransformerLens bridge replaced (empty for a plain model)."""
    return [name for name, m in model.named_modules() if is_bridge_component(m)]


def unwrap_object(obj: Any) -> tuple[nn.Module | Any, str]:
    """``(module, how)``: the module with the weights of ``obj`` and where it came from.

    ``how`` is ``"nnsight"`` (an nnsight ``NNsight`` / ``LanguageModel`` / ``Envoy``: its ``._module``),
    ``"bridge"`` (a TransformerLens ``TransformerBridge``: its ``original_model``) or ``"module"`` (``obj`` itself,
    whatever it is). Both are told by type.
    """
    if _from(obj, "nnsight") and isinstance(obj.__dict__.get("_module", None), nn.Module):
        return obj.__dict__["_module"], "nnsight"
    if _from(obj, "transformer_lens") and type(obj).__name__.endswith("Bridge") and isinstance(
            getattr(obj, "original_model", None), nn.Module):
        return obj.original_model, "bridge"
    return obj, "module"


def unbridged(model: nn.Module) -> nn.Module:
    """``model`` with every TransformerLens bridge component replaced by the module it wraps, as a view.

    Returns ``model`` itself when nothing was bridged. Otherwise each module on a path to a bridged one is a
    shallow copy whose ``_modules`` holds the originals; parameters, buffers, the config and every untouched
    module are the user's own objects. A copy gets its own (copied) hook dicts, so hooks registered on it never
    land on the user's module; the user's own hooks on that module still run, as on the original.
    """
    memo: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        if is_bridge_component(m):
            out = visit(m._modules[ORIGINAL])
        else:
            children = {name: (visit(c) if c is not None else None) for name, c in m._modules.items()}
            same = all(children[name] is c for name, c in m._modules.items())
            out = m if same else shallow_view(m, children)
        memo[id(m)] = out
        return out

    return visit(model)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def shallow_view(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A shallow copy of ``module`` whose children are ``children`` (the same parameters, buffers and config);
    its hook dicts are copies, so a hook registered on the view never lands on ``module``. A ``forward`` set on
    the instance (nnsight mounts one on every module) is bound to ``module`` and would run ``module``'s own
    children, so the view calls its class's ``forward``."""
    view = copy.copy(module)
    view.__dict__.pop("forward", None)
    view.__dict__["_modules"] = OrderedDict(children) if isinstance(module._modules, OrderedDict) else dict(children)
    for hooks in _HOOK_DICTS:
        if hooks in module.__dict__:
            view.__dict__[hooks] = copy.copy(module.__dict__[hooks])
    return view


def with_child(model: nn.Module, path: str, child: nn.Module) -> nn.Module:
    """A view of ``model`` whose submodule at the dotted ``path`` is ``child`` (every module on the path is a
    :func:`shallow_view`; nothing of ``model`` changes)."""
    head, _, rest = path.partition(".")
    new = child if not rest else with_child(model._modules[head], rest, child)
    return shallow_view(model, {**model._modules, head: new})
