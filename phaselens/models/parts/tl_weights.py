"""TransformerLens's weight names on every model kind (issue 46): per-block ``attn.W_Q/W_K/W_V/W_O`` and ``b_*``,
``mlp.W_in/W_gate/W_out/b_in/b_out``, and the model-level ``W_E``, ``W_U``, ``b_U``, ``W_pos``, stacked
``W_*`` and ``accumulated_bias``.

Shapes are TransformerLens's: ``W_Q/W_K/W_V`` ``[n_heads, d_model, d_head]``, ``W_O`` ``[n_heads, d_head,
d_model]``, ``b_Q/b_K/b_V`` ``[n_heads, d_head]``, ``b_O`` ``[d_model]``, ``W_in/W_gate`` ``[d_model, d_mlp]``,
``W_out`` ``[d_mlp, d_model]``, ``W_U`` ``[d_model, d_vocab]``.

Memory: where the weight is one matrix, the name is a **view** of the parameter (``.data_ptr()`` inside the
parameter's storage; no copy). An edit through a view (``with torch.no_grad(): attn.W_O[0] = 0``) reaches the
model. GQA's ``W_K`` / ``W_V`` are widened to every query head (TransformerLens 3.x's convention, and
phaselens' ``model.W_K``), which needs a copy: they are computed on access and not kept, and an edit of them does
not reach the model (edit ``attn.W_K_kv``, the view over the key heads). ``attn.b_*`` are ``None`` where the model
has no bias (as TransformerLens 4.3 reports a bias-free projection).

What a kind cannot give is a :class:`SurfaceError` (a :class:`~phaselens.errors.UnsupportedModelError` that
is also an ``AttributeError``, so ``hasattr`` and ``getattr(x, name, None)`` behave as on TransformerLens) that
says why and what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from phaselens.errors import InputError, UnsupportedModelError


class SurfaceError(UnsupportedModelError, AttributeError):
    """A TransformerLens name that this model kind cannot provide; the message says why and what to use."""


def widen(w: Tensor, n_heads: int) -> Tensor:
    """``w`` ``[n_kv, ...]`` with each KV head repeated over its query heads (KV-major): ``[n_heads, ...]``; ``w``
    itself when ``n_kv == n_heads`` (no copy)."""
    kv = w.shape[0]
    return w if kv == n_heads else w.repeat_interleave(n_heads // kv, dim=0)


# ---- the zoo's attention: flat parameters, TransformerLens-shaped names --------------------------------------
class _FlatHeads:
    """A TransformerLens-shaped view of an attention's flat parameter (``W_Q`` ``[D, H*d]``, ``W_K``/``W_V``/
    ``W_KV`` ``[D, Hkv*d]``, ``W_O`` ``[H*d, D]``); the parameter keeps its name, so checkpoints are unchanged.
    ``widened=False``: ``[n_kv_heads, d_model, d_head]``, the key (value) heads themselves, a view even under GQA."""

    def __init__(self, role: str, *, widened: bool = True) -> None:
        self.role, self.widened = role, widened

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        params = obj.__dict__.get("_parameters", {})
        role = self.role
        w = params.get(f"W_{role.upper()}")
        if w is None and role in "kv":
            w = params.get("W_KV")  # K = V layers: one matrix in both roles
        if w is None:  # during construction (nn.Module's hasattr check) and for absent weights
            raise AttributeError(self.name)
        cfg = obj.cfg
        H, Hkv, d, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
        if role == "o":
            return w.view(H, d, D)
        heads = H if role == "q" else Hkv
        out = w.view(D, heads, d).permute(1, 0, 2)
        return widen(out, H) if self.widened else out


class TLFlatAttention:
    """Mixin of an attention module whose weights are flat parameters ``W_Q`` ``[d_model, H*d]``, ``W_K`` / ``W_V``
    (or ``W_KV``) ``[d_model, Hkv*d]``, ``W_O`` ``[H*d, d_model]``, with ``self.cfg`` giving the sizes: the names read
    TransformerLens's shapes, the parameters (``flat(name)``, ``state_dict``) keep theirs."""

    W_Q = _FlatHeads("q")
    W_K = _FlatHeads("k")
    W_V = _FlatHeads("v")
    W_O = _FlatHeads("o")
    W_K_kv = _FlatHeads("k", widened=False)
    W_V_kv = _FlatHeads("v", widened=False)
    b_Q = b_K = b_V = b_O = None

    def flat(self, name: str) -> nn.Parameter:
        """The parameter ``name`` in its stored shape (what the forward multiplies by)."""
        return self._parameters[name]  # type: ignore[attr-defined]


# ---- model level ------------------------------------------------------------------------------------------
def stacked(path: str, shape: str, note: str = "") -> property:
    """A model-level property: ``blocks[l].<path>`` (``"attn.W_Q"``) stacked over the layers, a
    :class:`SurfaceError` where a block has none; ``shape`` its shape (``"[n_layers, n_heads, d_model, d_head]"``),
    ``note`` what else its docstring says."""
    part, name = path.split(".")

    def get(self: Any) -> Tensor:
        values = [getattr(getattr(b, part), name) for b in self.blocks]
        if any(v is None for v in values):
            raise SurfaceError(f"{path} is None on some block (a bias-free projection): there is nothing to stack.")
        return torch.stack(values)

    return property(get, doc=f"``{shape}``: ``blocks[l].{path}`` stacked. {note}".rstrip())


_ROTARY = ("this model has no learned position embedding: positions enter through rotary embeddings inside "
           "attention (cfg.positional_embedding_type == 'rotary'), so no position term is added to the residual.")


class ExplainedAttributes:
    """Mixin: a property that raises :class:`SurfaceError` keeps its message on a class with ``__getattr__``
    (``nn.Module``), where Python would otherwise answer "object has no attribute"."""

    def __getattr__(self, name: str) -> Any:
        # Python answers a property that raised AttributeError (a SurfaceError) by calling __getattr__, which
        # would replace the reason with "no attribute": call the property again so its own error is raised
        prop = getattr(type(self), name, None)
        if isinstance(prop, property) and prop.fget is not None:
            return prop.fget(self)
        parent = getattr(super(), "__getattr__", None)
        if parent is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return parent(name)


class TLModelWeights(ExplainedAttributes):
    """Mixin of a model kind with ``blocks`` (each ``attn`` / ``mlp`` carrying TransformerLens's weight names),
    ``W_U`` and ``cfg``: ``b_U``, ``W_pos``, the stacked biases and ``accumulated_bias``. A kind with a learned
    position embedding overrides :meth:`_position_embedding`."""

    def _position_embedding(self) -> Tensor | None:
        return None


    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        """The learned position embedding ``[n_ctx, d_model]`` (a view); rotary models raise a
        :class:`SurfaceError` saying so."""
        w = self._position_embedding()
        if w is None:
            raise SurfaceError(f"W_pos: {_ROTARY}")
        return w

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        """The unembedding bias ``[d_vocab]`` (zeros, not kept, when the head has none, as in TransformerLens)."""
        w = self.W_U  # type: ignore[attr-defined]
        b = self._unembed_bias()
        return torch.zeros(w.shape[-1], dtype=w.dtype, device=w.device) if b is None else b

    def _unembed_bias(self) -> Tensor | None:
        return None

    b_O = stacked("attn.b_O", "[n_layers, d_model]")
    b_in = stacked("mlp.b_in", "[n_layers, d_mlp]")
    b_out = stacked("mlp.b_out", "[n_layers, d_model]")

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
                         ) -> Float[Tensor, " d_model"]:
        """TransformerLens's ``accumulated_bias`` (what ``cache.get_full_resid_decomposition`` adds as its
        ``bias`` row): the sum of every attention output bias ``b_O`` (and MLP ``b_out`` with
        ``include_mlp_biases``) of the blocks before ``layer``, plus ``b_O`` of ``layer`` with ``mlp_input``;
        ``[d_model]`` zeros when the model has no biases."""
        blocks, like = self.blocks, self.W_U  # type: ignore[attr-defined]
        n = len(blocks)
        if not 0 <= layer <= n or (mlp_input and layer == n):
            raise InputError(f"accumulated_bias: layer must lie in 0..{n} (0..{n - 1} with mlp_input), got {layer}.")
        out = torch.zeros(self.cfg.d_model, dtype=like.dtype, device=like.device)  # type: ignore[attr-defined]
        for i in range(layer + (1 if mlp_input else 0)):
            b = blocks[i].attn.b_O
            if b is not None:
                out = out + b.to(out)
            if include_mlp_biases and i < layer:
                b = getattr(blocks[i].mlp, "b_out", None)
                if b is not None:
                    out = out + b.to(out)
        return out
