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

What a kind cannot give is a :class:`SurfaceError` (a :class:`~phaselens.core.errors.UnsupportedModelError` that
is also an ``AttributeError``, so ``hasattr`` and ``getattr(x, name, None)`` behave as on TransformerLens) that
says why and what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from phaselens.core.errors import UnsupportedModelError


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
    ``W_KV`` ``[D, Hkv*d]``, ``W_O`` ``[H*d, D]``); the parameter keeps its name, so checkpoints are unchanged."""

    def __init__(self, role: str) -> None:
        self.role = role

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        params = obj.__dict__.get("_parameters", {})
        role = self.role
        w = params.get(self.name)
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
        return widen(out, H)


def _flat_kv(obj: Any, name: str) -> Any:
    params = obj.__dict__.get("_parameters", {})
    w = params.get(name)
    return params.get("W_KV") if w is None else w


class _KVView(_FlatHeads):
    """``[n_kv_heads, d_model, d_head]``: the key (value) heads themselves, a view even under GQA."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        w = _flat_kv(obj, "W_K" if self.role == "k" else "W_V")
        if w is None:
            raise AttributeError(self.name)
        cfg = obj.cfg
        return w.view(cfg.d_model, cfg.n_key_value_heads, cfg.d_head).permute(1, 0, 2)


class TLFlatAttention:
    """Mixin of an attention module whose weights are flat parameters ``W_Q`` ``[d_model, H*d]``, ``W_K`` / ``W_V``
    (or ``W_KV``) ``[d_model, Hkv*d]``, ``W_O`` ``[H*d, d_model]``, with ``self.cfg`` giving the sizes: the names read
    TransformerLens's shapes, the parameters (``flat(name)``, ``state_dict``) keep theirs."""

    W_Q = _FlatHeads("q")
    W_K = _FlatHeads("k")
    W_V = _FlatHeads("v")
    W_O = _FlatHeads("o")
    W_K_kv = _KVView("k")
    W_V_kv = _KVView("v")
    b_Q = b_K = b_V = b_O = None

    def flat(self, name: str) -> nn.Parameter:
        """The parameter ``name`` in its stored shape (what the forward multiplies by)."""
        return self._parameters[name]  # type: ignore[attr-defined]


# ---- transformers models: views of nn.Linear / Conv1D weights ------------------------------------------------
def _io(module: nn.Module) -> Tensor:
    """The weight as ``[in, out]`` (a view: nn.Linear stores ``[out, in]``, GPT-2's Conv1D ``[in, out]``)."""
    w = module.weight
    return w if type(module).__name__ == "Conv1D" else w.T


def _bias(module: nn.Module | None) -> Tensor | None:
    b = getattr(module, "bias", None)
    return b if isinstance(b, Tensor) else None


class HFAttentionWeights:
    """TransformerLens's names over one transformers attention layer (``blocks[l].attn`` of a causal-LM adapter).

    ``W_Q`` ``[H, D, d]``, ``W_K``/``W_V`` ``[H, D, d]`` (widened under GQA: computed, not kept; ``W_K_kv`` /
    ``W_V_kv`` ``[Hkv, D, d]`` are views), ``W_O`` ``[H, d, D]``, ``b_*`` or ``None``. Qwen3's QK-norm follows
    ``W_Q``/``W_K`` (``hook_q`` is its output, not ``x @ W_Q``)."""

    def __init__(self, layout: Any, layer: int) -> None:
        self._lay, self._l = layout, layer

    def _parts(self, role: int) -> tuple[Tensor, Tensor | None]:
        """``(weight [D, heads*d], bias [heads*d] | None)`` of q (0), k (1) or v (2)."""
        lay, layer = self._lay, self._l
        sep = lay.qkv[layer][role]
        if sep is not None:
            return _io(sep), _bias(sep)
        fused = lay.fused[layer]
        H, Hkv, d = lay.n_heads, lay.n_kv_heads, lay.d_head
        start = (0, H * d, (H + Hkv) * d)[role]
        width = (H if role == 0 else Hkv) * d
        w, b = _io(fused), _bias(fused)
        return w[:, start:start + width], None if b is None else b[start:start + width]

    def _heads(self, role: int) -> Tensor:
        w, _ = self._parts(role)
        lay = self._lay
        return w.reshape(lay.d_model, -1, lay.d_head).permute(1, 0, 2)

    def _head_bias(self, role: int) -> Tensor | None:
        _, b = self._parts(role)
        return None if b is None else b.view(-1, self._lay.d_head)

    @property
    def W_Q(self) -> Float[Tensor, "n_heads d_model d_head"]:
        return self._heads(0)

    @property
    def W_K_kv(self) -> Float[Tensor, "n_kv d_model d_head"]:
        return self._heads(1)

    @property
    def W_V_kv(self) -> Float[Tensor, "n_kv d_model d_head"]:
        return self._heads(2)

    @property
    def W_K(self) -> Float[Tensor, "n_heads d_model d_head"]:
        return widen(self._heads(1), self._lay.n_heads)

    @property
    def W_V(self) -> Float[Tensor, "n_heads d_model d_head"]:
        return widen(self._heads(2), self._lay.n_heads)

    @property
    def W_O(self) -> Float[Tensor, "n_heads d_head d_model"]:
        lay = self._lay
        return _io(lay.out_proj[self._l]).view(lay.n_heads, lay.d_head, lay.d_model)

    @property
    def b_Q(self) -> Tensor | None:
        return self._head_bias(0)

    @property
    def b_K(self) -> Tensor | None:
        b = self._head_bias(1)
        return None if b is None else widen(b, self._lay.n_heads)

    @property
    def b_V(self) -> Tensor | None:
        b = self._head_bias(2)
        return None if b is None else widen(b, self._lay.n_heads)

    @property
    def b_O(self) -> Tensor | None:
        return _bias(self._lay.out_proj[self._l])

    def __repr__(self) -> str:
        lay = self._lay
        return f"blocks[{self._l}].attn (TransformerLens names over {type(lay.attn[self._l]).__name__})"


def mlp_parts(mlp: nn.Module | None) -> dict[str, nn.Module] | None:
    """The modules of a dense transformers MLP: ``{"in", "out", "act"[, "gate"]}`` (Llama: up/down/gate_proj and
    act_fn; GPT-2: c_fc/c_proj and act), ``None`` for an MLP of another layout (a mixture of experts)."""
    if mlp is None:
        return None
    m = mlp._modules
    if all(isinstance(m.get(n), nn.Module) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return {"gate": m["gate_proj"], "in": m["up_proj"], "out": m["down_proj"], "act": m["act_fn"]}
    if all(isinstance(m.get(n), nn.Module) for n in ("c_fc", "c_proj", "act")):
        return {"in": m["c_fc"], "out": m["c_proj"], "act": m["act"]}
    return None


_MOE = ("its MLP is not one dense layer (a mixture of experts, or a layout phaselens does not know), so there is no "
        "single W_in/W_out and no neuron hook: TransformerLens refuses neuron-level functions on sparse layers too. "
        "Use blocks.{l}.hook_mlp_out (the layer's output) or the experts' own modules (adapter.model).")


class HFMLPWeights:
    """TransformerLens's names over one transformers MLP: ``W_in`` (Llama: ``up_proj``), ``W_gate``, ``W_out``
    ``[d_mlp, D]``, ``b_in``, ``b_out`` (views). A mixture of experts raises :class:`SurfaceError`."""

    def __init__(self, layout: Any, layer: int) -> None:
        self._l = layer
        self._parts = mlp_parts(layout.mlp[layer])

    def _get(self, role: str) -> dict[str, nn.Module]:
        if self._parts is None:
            raise SurfaceError(f"blocks[{self._l}].mlp: " + _MOE.replace("{l}", str(self._l)))
        return self._parts

    @property
    def W_in(self) -> Float[Tensor, "d_model d_mlp"]:
        return _io(self._get("in")["in"])

    @property
    def W_gate(self) -> Float[Tensor, "d_model d_mlp"] | None:
        gate = self._get("gate").get("gate")
        return None if gate is None else _io(gate)

    @property
    def W_out(self) -> Float[Tensor, "d_mlp d_model"]:
        return _io(self._get("out")["out"])

    @property
    def b_in(self) -> Tensor | None:
        return _bias(self._get("in")["in"])

    @property
    def b_out(self) -> Tensor | None:
        return _bias(self._get("out")["out"])

    def __repr__(self) -> str:
        return f"blocks[{self._l}].mlp (TransformerLens names)"


class HFBlock:
    """``adapter.blocks[l]``: ``attn`` and ``mlp`` with TransformerLens's weight names, ``ln1`` / ``ln2`` the
    transformers norms. Hooks are reached by name through the adapter (``blocks.{l}.attn.hook_z``)."""

    residual_contribution_scale = 1.0
    hook_out_is_single_residual_stream = True

    def __init__(self, layout: Any, layer: int) -> None:
        self.layer = layer
        self.attn = HFAttentionWeights(layout, layer)
        self.mlp = HFMLPWeights(layout, layer)
        block = layout.layers[layer]
        self.ln1 = next((block._modules[n] for n in ("input_layernorm", "ln_1") if n in block._modules), None)
        self.ln2 = layout.norm2[layer]

    def __repr__(self) -> str:
        return f"HFBlock({self.layer})"


# ---- model level ------------------------------------------------------------------------------------------
def accumulated_bias(blocks: Any, d_model: int, like: Tensor, layer: int, mlp_input: bool = False,
                     include_mlp_biases: bool = True) -> Float[Tensor, " d_model"]:
    """TransformerLens's ``accumulated_bias``: the sum of every attention output bias ``b_O`` (and MLP ``b_out``
    with ``include_mlp_biases``) of the blocks before ``layer``, plus ``b_O`` of ``layer`` with ``mlp_input``;
    ``[d_model]`` zeros when the model has no biases. ``like`` gives dtype and device."""
    from phaselens.core.errors import InputError

    n = len(blocks)
    if not 0 <= layer <= n or (mlp_input and layer == n):
        raise InputError(f"accumulated_bias: layer must lie in 0..{n} (0..{n - 1} with mlp_input), got {layer}.")
    out = torch.zeros(d_model, dtype=like.dtype, device=like.device)
    for i in range(layer + (1 if mlp_input else 0)):
        b = blocks[i].attn.b_O
        if b is not None:
            out = out + b.to(out)
        if include_mlp_biases and i < layer:
            b = getattr(blocks[i].mlp, "b_out", None)
            if b is not None:
                out = out + b.to(out)
    return out


def stack_blocks(blocks: Any, path: str) -> Tensor:
    """``[n_layers, ...]`` of ``blocks[l].<path>`` (``"attn.W_Q"``); a :class:`SurfaceError` where a block has none."""
    part, name = path.split(".")
    values = [getattr(getattr(b, part), name) for b in blocks]
    if any(v is None for v in values):
        raise SurfaceError(f"{path} is None on some block (a bias-free projection): there is nothing to stack.")
    return torch.stack(values)


_ROTARY = ("this model has no learned position embedding: positions enter through rotary embeddings inside "
           "attention (cfg.positional_embedding_type == 'rotary'), so no position term is added to the residual.")


class TLModelWeights:
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

    @property
    def b_O(self) -> Float[Tensor, "n_layers d_model"]:
        return stack_blocks(self.blocks, "attn.b_O")  # type: ignore[attr-defined]

    @property
    def b_in(self) -> Float[Tensor, "n_layers d_mlp"]:
        return stack_blocks(self.blocks, "mlp.b_in")  # type: ignore[attr-defined]

    @property
    def b_out(self) -> Float[Tensor, "n_layers d_model"]:
        return stack_blocks(self.blocks, "mlp.b_out")  # type: ignore[attr-defined]

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
                         ) -> Float[Tensor, " d_model"]:
        """TransformerLens's ``accumulated_bias`` (what ``cache.get_full_resid_decomposition`` adds as its
        ``bias`` row): see :func:`accumulated_bias`."""
        return accumulated_bias(self.blocks, self.cfg.d_model, self.W_U, layer, mlp_input,  # type: ignore[attr-defined]
                                include_mlp_biases)
