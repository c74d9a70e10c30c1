"""TransformerLens's weight names over a transformers causal LM (``adapter.blocks[l].attn`` / ``.mlp``, issue 46),
as views of the transformers parameters: see :mod:`.tl_weights` for the shapes and the memory rule, and
:class:`HFSurface` for the model-level names of the causal-LM adapter."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from phaselens.errors import InputError
from phaselens.models.parts.tl_split_qkv import SplitQKV
from phaselens.models.parts.tl_weights import SurfaceError, TLModelWeights, stacked, widen


# ---- transformers models: views of nn.Linear / Conv1D weights ------------------------------------------------
def _io(module: nn.Module) -> Tensor:
    """The weight as ``[in, out]`` (a view: nn.Linear stores ``[out, in]``, GPT-2's Conv1D ``[in, out]``)."""
    w = module.weight
    return w if type(module).__name__ == "Conv1D" else w.T


def _bias(module: nn.Module | None) -> Tensor | None:
    b = getattr(module, "bias", None)
    return b if isinstance(b, Tensor) else None


def _head_view(role: int, shape: str, *, widened: bool = False, bias: bool = False) -> property:
    """The weight (``bias``: the bias) of q (``role`` 0), k (1) or v (2) per head, ``shape``; ``widened``: the
    KV heads repeated over their query heads (a copy under GQA)."""

    def get(self: HFAttentionWeights) -> Tensor | None:
        t = self._head_bias(role) if bias else self._heads(role)
        return t if t is None or not widened else widen(t, self._lay.n_heads)

    return property(get, doc=f"``{shape}``")


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

    W_Q = _head_view(0, "[n_heads, d_model, d_head]")
    W_K_kv = _head_view(1, "[n_kv, d_model, d_head]")
    W_V_kv = _head_view(2, "[n_kv, d_model, d_head]")
    W_K = _head_view(1, "[n_heads, d_model, d_head]", widened=True)
    W_V = _head_view(2, "[n_heads, d_model, d_head]", widened=True)
    b_Q = _head_view(0, "[n_heads, d_head] or None", bias=True)
    b_K = _head_view(1, "[n_heads, d_head] or None", widened=True, bias=True)
    b_V = _head_view(2, "[n_heads, d_head] or None", widened=True, bias=True)

    @property
    def W_O(self) -> Float[Tensor, "n_heads d_head d_model"]:
        lay = self._lay
        return _io(lay.out_proj[self._l]).view(lay.n_heads, lay.d_head, lay.d_model)

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


def _mlp_view(role: str, shape: str, *, bias: bool = False) -> property:
    """The weight ``[in, out]`` (``bias``: the bias) of an MLP's ``"in"``, ``"gate"`` or ``"out"`` module,
    ``shape``; ``None`` where the MLP has no such module (no gate) or it has no bias."""

    def get(self: HFMLPWeights) -> Tensor | None:
        module = self._get(role).get(role)
        return None if module is None else _bias(module) if bias else _io(module)

    return property(get, doc=f"``{shape}``")


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

    W_in = _mlp_view("in", "[d_model, d_mlp]")
    W_gate = _mlp_view("gate", "[d_model, d_mlp] or None")
    W_out = _mlp_view("out", "[d_mlp, d_model]")
    b_in = _mlp_view("in", "[d_mlp] or None", bias=True)
    b_out = _mlp_view("out", "[d_model] or None", bias=True)

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




def neuron_tags(mlp: nn.Module | None) -> tuple[str, ...]:
    """The hook-table tags of a layer's MLP: ``"neurons"`` (a dense MLP: ``hook_pre`` / ``hook_post``) and
    ``"gated"`` (it has a gate: ``hook_pre_linear``)."""
    parts = mlp_parts(mlp)
    return () if parts is None else ("neurons", "gated") if "gate" in parts else ("neurons",)


_TRAIN = ("phaselens runs every forward of an adapter in evaluation mode (dropout off) and restores the wrapped "
          "model's modes afterwards, so train() would change nothing; train the transformers model itself "
          "(adapter.model.train()).")


class HFSurface(TLModelWeights):
    """TransformerLens's model surface on the causal-LM adapter (a mixin reading ``self._layout`` and
    ``self.model``): ``blocks``, ``W_E``, ``W_pos`` (GPT-2's ``wpe``), ``b_U``, stacked ``W_Q ... W_out``, ``b_*``,
    ``accumulated_bias``, ``eval()``, ``train(False)``, ``to()``, ``parameters()`` and ``state_dict()``."""

    _layout: Any
    model: nn.Module

    @property
    def blocks(self) -> list[HFBlock]:
        """Per layer, :class:`HFBlock` (``attn`` / ``mlp`` weight views, ``ln1`` / ``ln2``)."""
        cached = self.__dict__.get("_tl_blocks")
        if cached is None or cached[0] is not self._layout:
            cached = (self._layout, [HFBlock(self._layout, i) for i in range(self._layout.n_layers)])
            self.__dict__["_tl_blocks"] = cached
        return cached[1]

    def _d_mlp(self) -> int | None:
        """The MLP width (``W_out.shape[0]`` of block 0); ``None`` for a mixture of experts (TransformerLens too)."""
        parts = mlp_parts(self._layout.mlp[0])
        return None if parts is None else int(self.blocks[0].mlp.W_out.shape[0])

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self._layout.embed.weight

    def _position_embedding(self) -> Tensor | None:
        return None if self._layout.pos_embed is None else self._layout.pos_embed.weight

    @property
    def unembed(self) -> nn.Module:
        """The model's output embedding (``lm_head``): ``logits = unembed(ln_final(resid))``, as TransformerLens's
        logit lens reads it."""
        return self.model.get_output_embeddings()

    def _unembed_bias(self) -> Tensor | None:
        return _bias(self.model.get_output_embeddings())

    W_Q = stacked("attn.W_Q", "[n_layers, n_heads, d_model, d_head]")
    W_K = stacked("attn.W_K", "[n_layers, n_heads, d_model, d_head]")
    W_V = stacked("attn.W_V", "[n_layers, n_heads, d_model, d_head]")
    W_O = stacked("attn.W_O", "[n_layers, n_heads, d_head, d_model]",
                  '``hook_attn_out = einsum("bnhd,hdm->bnm", hook_z, W_O[l])`` (+ bias).')
    W_in = stacked("mlp.W_in", "[n_layers, d_model, d_mlp]")
    W_out = stacked("mlp.W_out", "[n_layers, d_mlp, d_model]")
    W_gate = stacked("mlp.W_gate", "[n_layers, d_model, d_mlp]")

    # ---- torch module habits, passed to the wrapped model ------------------------------------------------
    def eval(self) -> Any:
        """Put the wrapped model in evaluation mode (phaselens' forwards run in it anyway); returns the adapter."""
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> Any:
        """``train(False)`` is :meth:`eval`; ``train(True)`` is a :class:`SurfaceError` (see its message)."""
        if mode:
            raise SurfaceError(f"train(): {_TRAIN}")
        return self.eval()

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """Move or cast the wrapped model (``torch.nn.Module.to``'s arguments); returns the adapter."""
        if any(isinstance(a, torch.Tensor) for a in args):
            raise InputError("adapter.to(tensor) is not supported: pass a device or a dtype.")
        self.model.to(*args, **kwargs)
        return self

    def parameters(self, recurse: bool = True) -> Any:
        return self.model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.state_dict(*args, **kwargs)


class HFSplitQKV(SplitQKV):
    """:class:`~.tl_split_qkv.SplitQKV` of the causal-LM adapter: ``ln1`` is the block's first norm, the weights
    are :class:`HFAttentionWeights` views, Qwen3's QK-norms follow the projection (as ``hook_q`` / ``hook_k`` do)."""

    def _split_parts(self, layer: int, c: str) -> tuple[Any, Tensor, Tensor | None, Any]:
        block = self.blocks[layer]  # type: ignore[attr-defined]
        if block.ln1 is None:
            raise SurfaceError(f"blocks[{layer}] has no input norm phaselens can find (input_layernorm / ln_1), so "
                               "the per-head pre-norm inputs cannot be formed.")
        role = "qkv".index(c)
        weight = {"q": block.attn.W_Q, "k": block.attn.W_K_kv, "v": block.attn.W_V_kv}[c]
        lay = self._layout  # type: ignore[attr-defined]
        norm = {"q": lay.q_norm[layer], "k": lay.k_norm[layer], "v": None}[c]
        return block.ln1, weight, block.attn._head_bias(role), (lambda t: t) if norm is None else norm
