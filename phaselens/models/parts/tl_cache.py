"""What :class:`~phaselens.models.parts.tl_habits.PhaseCache` adds to TransformerLens's ``ActivationCache`` so that
the whole class gives TransformerLens's answer on phaselens models (issue 46, item 2), or a
:class:`~phaselens.models.parts.tl_weights.SurfaceError` saying why not:

* ``apply_slice_to_batch_dim`` returns the same kind of cache (TransformerLens builds a plain ``ActivationCache``,
  which would lose phaselens' computed ``hook_scale``, so ``apply_ln=True`` on a sliced cache would fail);
* neuron-level methods (``get_neuron_results``, ``stack_neuron_results``, ``get_full_resid_decomposition`` with
  ``expand_neurons=True``) on a model whose MLPs are mixtures of experts (``cfg.d_mlp is None``) say so, where
  TransformerLens fails with an ``AssertionError`` or ``AttributeError`` from inside;
* ``get_full_resid_decomposition`` honours the kind's ``tl_limits`` (hyper-connection streams) before it reads
  ``accumulated_bias``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transformer_lens import ActivationCache

from phaselens.errors import UnsupportedModelError
from phaselens.models.parts.tl_weights import SurfaceError

_NO_NEURONS = ("{what} needs MLP neurons, but {model}'s MLPs are mixtures of experts (cfg.d_mlp is None): there "
               "is no single W_out and no hook_post, as in TransformerLens. Use the MLP outputs instead "
               "(get_full_resid_decomposition(expand_neurons=False), decompose_resid(), blocks.{{l}}.hook_mlp_out).")


def limit(model: Any, what: str, error: type[Exception] = UnsupportedModelError) -> None:
    """Refuse ``what`` (a TransformerLens method) where the model's ``tl_limits`` say why it cannot apply."""
    reason = dict(getattr(model, "tl_limits", {}) or {}).get(what)
    if reason:
        raise error(f"{what} does not apply to {type(model).__name__}: {reason}")


def checked(method: str, check: Callable[[Any], None], doc: str = "") -> Callable[..., Any]:
    """TransformerLens's ``ActivationCache.<method>``, run after ``check(cache)`` (which raises where the model
    cannot give it); ``doc`` its docstring (TransformerLens's if empty)."""
    base = getattr(ActivationCache, method)

    @functools.wraps(base)  # TransformerLens's name and signature, as help() and a notebook show them
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        check(self)
        return base(self, *args, **kwargs)

    call.__doc__ = doc or base.__doc__
    return call


class CacheCompletion:
    """Mixin placed before ``ActivationCache`` in :class:`PhaseCache`'s bases."""

    model: Any

    def _need_neurons(self, what: str) -> None:
        if getattr(self.model.cfg, "d_mlp", None) is None:
            raise SurfaceError(_NO_NEURONS.format(what=what, model=type(self.model).__name__))

    def apply_slice_to_batch_dim(self, batch_slice: Any) -> Any:
        """TransformerLens's ``apply_slice_to_batch_dim``, returning a cache of this class (computed scales kept)."""
        out = ActivationCache.apply_slice_to_batch_dim(self, batch_slice)  # type: ignore[arg-type]
        return type(self)(out.cache_dict, self.model, has_batch_dim=out.has_batch_dim)

    get_neuron_results = checked("get_neuron_results", lambda c: c._need_neurons("get_neuron_results"))
    stack_neuron_results = checked("stack_neuron_results", lambda c: c._need_neurons("stack_neuron_results"))

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, *args: Any, **kwargs: Any) -> Any:
        limit(self.model, "decompose_resid", SurfaceError)
        if expand_neurons:
            self._need_neurons("get_full_resid_decomposition(expand_neurons=True)")
        return super().get_full_resid_decomposition(layer, mlp_input, expand_neurons,  # type: ignore[misc]
                                                    *args, **kwargs)
