"""Model objects the user already holds, routed to the model kind that adapts them.

``phaselens.load(obj)``, ``phaselens.from_hf(obj)`` and every analysis (through
:func:`phaselens.contract.adapting.as_phase_model`, where this module's :func:`adapt_object` is registered)
accept:

* a transformers model: DeepSeek-V4 (``model_type`` ``deepseek_v4``) goes to
  :func:`phaselens.models.deepseek_v4.from_hf`; any other causal LM to
  :func:`phaselens.models.causal_lm.from_transformers`, which needs ``stride=`` (no compression to read it from);
* an nnsight ``NNsight`` / ``LanguageModel`` envoy: its module (``._module``) is adapted;
* a TransformerLens ``TransformerBridge``, or the transformers model a bridge was booted over
  (``bridge.original_model``): the bridge replaced the model's components in place, so the model is read
  through a view with its original modules (:func:`~phaselens.models.wrappers.unbridged`), and the numbers are
  those of the transformers model itself.

Anything else gets a :class:`~phaselens.core.errors.PhaseLensError` naming the route that works.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from phaselens.contract.adapting import is_phase_model
from phaselens.core.errors import InputError, UnsupportedModelError
from phaselens.models.wrappers import unbridged, unwrap_object

ROUTES = ("phaselens.load('hf:DIR', stride=4) for a local transformers checkpoint; phaselens.load(model, stride=4) "
          "for a transformers causal LM object, an nnsight envoy or a TransformerLens bridge of one")


def adapt_object(obj: Any, *, stride: int | None = None, window: int | None = None, origin: int = 0,
                 **options: Any) -> Any:
    """``obj`` as a phaselens model, or ``None`` when it is not a model object at all (a phaselens model is
    returned as is).

    Args:
        obj: a transformers model, an nnsight envoy, a TransformerLens bridge, or the model a bridge rewired.
        stride, window, origin: the geometry of a model without compression (``stride`` required there).
        options: for DeepSeek-V4, :func:`phaselens.models.deepseek_v4.from_hf`'s keywords.
    """
    if is_phase_model(obj):
        return obj
    module, how = unwrap_object(obj)
    if is_phase_model(module):  # an envoy or bridge of a phaselens model
        return module
    if not isinstance(module, nn.Module):
        return None
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or not hasattr(module, "get_input_embeddings"):
        raise UnsupportedModelError(
            f"{type(obj).__name__} is a torch module but not a transformers model phaselens can adapt; use "
            f"{ROUTES}, or a phaselens model."
        )
    if model_type == "deepseek_v4":
        from phaselens.models.deepseek_v4 import from_hf as v4_from_hf

        if options.get("backend") == "nnsight" and how == "nnsight":
            return v4_from_hf(obj, **options)
        return v4_from_hf(unbridged(module), **options)
    if options:
        raise InputError(f"{sorted(options)} apply to DeepSeek-V4 models only; a {type(module).__name__} takes "
                         "stride=, window= and origin=.")
    from phaselens.models.causal_lm import from_transformers

    return from_transformers(module, stride=stride, window=window, origin=origin)


def from_hf(model: Any, **kwargs: Any) -> Any:
    """``phaselens.from_hf``: a transformers model object (or an nnsight envoy, or a TransformerLens bridge of one)
    as a phaselens model.

    DeepSeek-V4 takes :func:`phaselens.models.deepseek_v4.from_hf`'s keywords (``analysis_stride``,
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
