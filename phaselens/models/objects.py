"""Model objects the user already holds, routed to the model kind that adapts them.

``phaselens.load(obj)``, ``phaselens.from_hf(obj)`` and every analysis (through
:func:`phaselens.contract.adapting.as_phase_model`, where this module's :func:`adapt_object` is registered)
accept:

* a transformers model: the kind that claims its ``model_type`` in the registry (:mod:`phaselens.models.kinds`)
  adapts it: DeepSeek-V4 (``deepseek_v4``) through :func:`phaselens.models.deepseek_v4.from_transformers`, any
  other causal LM through :func:`phaselens.models.causal_lm.from_transformers`, which needs ``stride=`` (no
  compression to read it from);
* an nnsight ``NNsight`` / ``LanguageModel`` envoy: its module (``._module``) is adapted;
* a TransformerLens ``TransformerBridge``, or the transformers model a bridge was booted over
  (``bridge.original_model``): the bridge replaced the model's components in place, so the model is read
  through a view with its original modules (:func:`~phaselens.models.parts.wrappers.unbridged`), and the numbers are
  those of the transformers model itself.

Anything else gets a :class:`~phaselens.errors.PhaseLensError` naming the route that works.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from phaselens.contract.adapting import is_phase_model
from phaselens.contract.strides import check_stride, compression_strides, refuse_restride
from phaselens.errors import InputError, UnsupportedModelError
from phaselens.models.kinds import by_model_type
from phaselens.models.parts.wrappers import unwrap_object

ROUTES = ("phaselens.load('hf:DIR', stride=4) for a local transformers checkpoint; phaselens.load(model, stride=4) "
          "for a transformers causal LM object, an nnsight envoy or a TransformerLens bridge of one")


def adapt_object(obj: Any, *, stride: int | None = None, window: int | None = None, origin: int | None = None,
                 **options: Any) -> Any:
    """``obj`` as a phaselens model, or ``None`` when it is not a model object at all.

    A phaselens model given a geometry follows the one rule for strides (:mod:`phaselens.contract.strides`): one
    without compression is adapted anew at it (an adapter is never returned at its old stride); one with
    compression is returned as it is when the stride is its own, and refused otherwise.

    Args:
        obj: a transformers model, an nnsight envoy, a TransformerLens bridge, the model a bridge rewired, or a
            phaselens model.
        stride, window, origin: the geometry of a model without compression (``stride`` required there).
        options: for DeepSeek-V4, :func:`phaselens.models.deepseek_v4.from_transformers`'s keywords (``stride=`` is its
            ``analysis_stride``).
    """
    if is_phase_model(obj):
        return _regeometry(obj, stride, window, origin, options)
    module, how = unwrap_object(obj)
    if is_phase_model(module):  # an envoy or bridge of a phaselens model
        return _regeometry(module, stride, window, origin, options)
    if not isinstance(module, nn.Module):
        return None
    config = getattr(module, "config", None)
    if config is None and _is_hooked_transformer(module):
        raise UnsupportedModelError(HOOKED_TRANSFORMER.format(name=type(obj).__name__))
    if config is None or not hasattr(module, "get_input_embeddings"):
        raise UnsupportedModelError(
            f"{type(obj).__name__} is a torch module but not a transformers model phaselens can adapt; use "
            f"{ROUTES}, or a phaselens model."
        )
    kind = by_model_type(str(getattr(config, "model_type", None)))
    adapt = kind.adapter()
    if adapt is None:
        raise UnsupportedModelError(f"{type(module).__name__} is {kind.what}, which phaselens builds itself: load it "
                                    "from its checkpoint directory with phaselens.load('hf:DIR').")
    return adapt(obj, module, how, stride=stride, window=window, origin=origin, **options)


def _regeometry(model: Any, stride: Any, window: Any, origin: Any, options: dict[str, Any]) -> Any:
    """A phaselens model at the geometry a ``load(model, stride=, window=, origin=)`` asks for (see
    :func:`adapt_object`)."""
    if options:
        raise InputError(f"{sorted(options)} apply when a transformers model is adapted; {type(model).__name__} is "
                         "already a phaselens model (load its checkpoint again with them).")
    if stride is None and window is None and origin is None:
        return model
    restride = getattr(model, "with_geometry", None)
    own = model.dims.analysis_spec
    if callable(restride):
        return restride(own.stride if stride is None else stride, window, origin)
    strides = compression_strides(model)
    name = str(getattr(model, "name", type(model).__name__))
    if window is not None or origin is not None:
        raise InputError(f"window= and origin= set the geometry of a model without compression; {name} takes its "
                         "geometry from its compressed layers.")
    s = check_stride(stride, strides, what=name)
    if s != own.stride:
        raise refuse_restride(model, s, own.stride, name)
    return model


def from_hf(model: Any, **kwargs: Any) -> Any:
    """``phaselens.from_hf``: a transformers model object (or an nnsight envoy, or a TransformerLens bridge of one)
    as a phaselens model.

    DeepSeek-V4 takes :func:`phaselens.models.deepseek_v4.from_transformers`'s keywords (``analysis_stride``,
    ``index_topk``, ``backend``, ``chunk``, ``numerics``, ``quantize``, ...); any other causal LM takes
    ``stride=`` (required), ``window=``, ``origin=`` (:func:`phaselens.models.causal_lm.from_transformers`). A
    model a TransformerLens bridge rewired is read through its original modules, so every hook is measured.
    """
    if is_phase_model(model):
        raise InputError(f"{type(model).__name__} is already a phaselens model; it needs no adapter.")
    out = adapt_object(model, **kwargs)
    if out is None:
        raise UnsupportedModelError(f"{type(model).__name__} is not a model object; use {ROUTES}.")
    return out


HOOKED_TRANSFORMER = (
    "{name} looks like a TransformerLens 3.x HookedTransformer (a torch module with cfg, blocks and W_E but no "
    "transformers config). TransformerLens 4.3, which phaselens requires, no longer has that class, and phaselens "
    "adapts transformers models. Bring the model in one of two ways: (1) as a transformers model: load the "
    "checkpoint it was converted from, transformers.AutoModelForCausalLM.from_pretrained(NAME_OR_DIR) (for weights "
    "you trained in TransformerLens, write them into that architecture and save_pretrained(DIR) first), then "
    "phaselens.load(hf_model, stride=...); or (2) boot a TransformerBridge, "
    "transformer_lens.model_bridge.TransformerBridge.boot_transformers(NAME_OR_DIR), and pass the bridge: "
    "phaselens.load(bridge, stride=...) unwraps it. docs/transformer_lens.md shows both."
)


def _is_hooked_transformer(module: nn.Module) -> bool:
    """A TransformerLens 3.x ``HookedTransformer`` (or a model built like one): ``cfg``, ``blocks`` and ``W_E``."""
    return all(hasattr(module, a) for a in ("cfg", "blocks", "W_E")) or type(module).__name__ == "HookedTransformer"
