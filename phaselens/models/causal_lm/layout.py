"""Where a transformers causal LM keeps its parts: a small table of module names per architecture family.

Every family the table knows lays a decoder block out the same way (a pre-norm residual block whose attention
module projects q, k, v, runs transformers' attention interface, and applies one output projection to the
concatenated heads); only the names differ:

================  =====================  ============  ===========================  ===========  =========================
family            layers (from the LM)   attention     q, k, v                      output       norm before the MLP
================  =====================  ============  ===========================  ===========  =========================
llama-like        ``model.layers``       ``self_attn`` ``q_proj k_proj v_proj``     ``o_proj``   ``post_attention_layernorm``
gpt2              ``transformer.h``      ``attn``      ``c_attn`` (fused, split 3)  ``c_proj``   ``ln_2``
================  =====================  ============  ===========================  ===========  =========================

Llama, Mistral, Qwen2, Qwen3 (and the phaselens family's Qwen3 export) are llama-like; Qwen3's ``q_norm`` /
``k_norm`` are found when present. Other model types whose modules carry these names are taken too (the
attention itself always runs through the model's own code), except that ``hook_resid_mid`` is offered only for
the model types listed in :data:`PRE_NORM_TYPES`, where the second norm's input is the residual stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phaselens.errors import UnsupportedModelError

LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")
ATTENTION = ("self_attn", "attn", "attention")
OUTPUT = ("o_proj", "c_proj", "out_proj", "dense")
SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
FUSED_QKV = ("c_attn", "qkv_proj")
NORM2 = ("post_attention_layernorm", "ln_2")
PRE_NORM_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})
TESTED_TYPES = PRE_NORM_TYPES  # tests/models/causal_lm holds these against plain transformers forwards


@dataclass(frozen=True)
class Layout:
    """The modules of one transformers causal LM that the hooks sit on.

    Attributes:
        layers: the decoder blocks, in order.
        attn, out_proj, mlp: per block, the attention module, its output projection (its input is ``z``,
            ``[B, n, H * d]``) and the MLP.
        qkv: per block ``(q, k, v)`` modules, or ``None`` per entry when fused.
        fused: per block the fused q/k/v projection (GPT-2's ``c_attn``), else ``None``.
        q_norm, k_norm: per block Qwen3's QK-norms (``hook_q`` / ``hook_k`` sit on their outputs), else ``None``.
        norm2: per block the norm whose input is ``hook_resid_mid`` (``None``: no such hook).
        embed: the token embedding; pos_embed: the learned position embedding (``None``: rotary); n_heads, n_kv_heads, d_head, d_model, d_vocab, n_ctx: the sizes.
    """

    layers: tuple[nn.Module, ...]
    attn: tuple[nn.Module, ...]
    out_proj: tuple[nn.Module, ...]
    mlp: tuple[nn.Module | None, ...]
    qkv: tuple[tuple[nn.Module | None, nn.Module | None, nn.Module | None], ...]
    fused: tuple[nn.Module | None, ...]
    q_norm: tuple[nn.Module | None, ...]
    k_norm: tuple[nn.Module | None, ...]
    norm2: tuple[nn.Module | None, ...]
    embed: nn.Module
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_vocab: int
    n_ctx: int
    layers_path: str
    pos_embed: nn.Module | None = None  # GPT-2's learned position embedding (wpe), added to the token embedding

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _first(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        child = module._modules.get(name)
        if isinstance(child, nn.Module):
            return child
    return None


def config_int(config: Any, *names: str, default: int | None = None) -> int:
    """The first of ``names`` the config sets (transformers' families name the same size differently)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise UnsupportedModelError(f"the model's config has none of {names}; phaselens cannot size it.")
    return default


def model_layout(model: nn.Module) -> Layout:
    """The :class:`Layout` of ``model`` (a transformers ``...ForCausalLM``), or an
    :class:`~phaselens.errors.UnsupportedModelError` naming what is missing."""
    what = f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"
    path = next((p for p in LAYER_PATHS if isinstance(_get(model, p), nn.ModuleList)), None)
    if path is None:
        raise UnsupportedModelError(
            f"{what} has no decoder layers at any of {list(LAYER_PATHS)}; phaselens adapts transformers causal LMs "
            "laid out as Llama, Qwen2/3, Mistral or GPT-2 (docs/causal_lm.md)."
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = tuple(_get(model, path))
    attn, out, mlp, qkv, fused, qn, kn, n2 = [], [], [], [], [], [], [], []
    for i, layer in enumerate(layers):
        a = _first(layer, ATTENTION)
        o = _first(a, OUTPUT) if a is not None else None
        if a is None or o is None:
            raise UnsupportedModelError(
                f"{what}: layer {i} has no attention module ({'/'.join(ATTENTION)}) with an output projection "
                f"({'/'.join(OUTPUT)}); its per-head z cannot be reached."
            )
        attn.append(a)
        out.append(o)
        mlp.append(_first(layer, ("mlp",)))
        sep = tuple(_first(a, (n,)) for n in SEPARATE_QKV)
        qkv.append(sep)
        fused.append(None if all(s is not None for s in sep) else _first(a, FUSED_QKV))
        qn.append(_first(a, ("q_norm",)))
        kn.append(_first(a, ("k_norm",)))
        n2.append(_first(layer, NORM2) if getattr(config, "model_type", None) in PRE_NORM_TYPES else None)
    H = config_int(config, "num_attention_heads", "n_head")
    D = config_int(config, "hidden_size", "n_embd")
    d = getattr(config, "head_dim", None) or D // H
    Hkv = config_int(config, "num_key_value_heads", default=H) or H
    width = _in_features(out[0])
    if width is not None and width != H * d:
        raise UnsupportedModelError(
            f"{what}: the output projection reads {width} features, not heads x head_dim = {H} x {d}; phaselens "
            "cannot split its input into per-head z."
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise UnsupportedModelError(f"{what} has no language-model head; pass a ...ForCausalLM model.")
    n_ctx = config_int(config, "max_position_embeddings", "n_positions", "n_ctx", default=2**31 - 1)
    return Layout(tuple(layers), tuple(attn), tuple(out), tuple(mlp), tuple(qkv), tuple(fused), tuple(qn), tuple(kn),
                  tuple(n2), model.get_input_embeddings(), H, Hkv, int(d), D, int(head.weight.shape[0]), n_ctx, path,
                  wpe if isinstance(wpe := base_module(model, "wpe"), nn.Embedding) else None)


def base_module(model: nn.Module, name: str) -> nn.Module | None:
    """The module ``name`` of the model's base (``model.model``; GPT-2's ``transformer``), else ``None``."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    found = getattr(base, name, None)
    return found if isinstance(found, nn.Module) else None


def _in_features(module: nn.Module) -> int | None:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    # nn.Linear stores [out, in]; transformers' GPT-2 Conv1D stores [in, out] and says nf (out features)
    return int(w.shape[0]) if type(module).__name__ == "Conv1D" else int(w.shape[1])
