"""Qwen3 as a :class:`CompressedTransformer`: configs and weights both ways with transformers' ``Qwen3ForCausalLM``.

A Qwen3 decoder is a :class:`CompressedConfig` with ``qk_norm=True, mlp="swiglu", mlp_bias=False, sink=False``,
a ``"half"`` RoPE over the whole head and (for the small sizes) ``tie_embeddings=True``. With
``compression=None`` the two models compute the same function (``tests/models/compressed/test_qwen3.py`` holds the fp32 logits
to 1e-5); with a :class:`CompressorSpec` the same backbone gets compressed attention (the paper's family).

Weight names (transformers -> phaselens, ``W`` transposed to phaselens's ``x @ W`` convention)::

    model.embed_tokens.weight                 embed.weight (and unembed.weight when tied)
    model.layers.L.input_layernorm.weight     blocks.L.ln1.weight
    model.layers.L.self_attn.{q,k,v,o}_proj   blocks.L.attn.W_{Q,K,V,O}
    model.layers.L.self_attn.{q,k}_norm       blocks.L.attn.{q,k}_norm
    model.layers.L.post_attention_layernorm   blocks.L.ln2.weight
    model.layers.L.mlp.{gate,up,down}_proj    blocks.L.mlp.W_{gate,in,out}
    model.norm.weight                         ln_final.weight
    lm_head.weight                            unembed.weight
"""

from __future__ import annotations

from typing import Any

import torch

from phaselens.errors import ConfigError
from phaselens.models.compressed.config import CompressedConfig, CompressorSpec, RopeSpec
from phaselens.models.compressed.transformer import CompressedTransformer

# Qwen3-0.6B as published (huggingface.co/Qwen/Qwen3-0.6B config.json).
QWEN3_0_6B = dict(n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, d_head=128, d_mlp=3072, d_vocab=151936,
                  n_ctx=40960, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def _rope_theta(hf_config: Any) -> float:
    params = _get(hf_config, "rope_parameters") or {}
    if isinstance(params, dict) and params.get("rope_type", "default") not in ("default", None):
        raise ConfigError(f"Qwen3 rope_type {params.get('rope_type')!r} is not supported; only the default RoPE is.")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else _get(hf_config, "rope_theta", 10000.0))


def qwen3_config(hf_config: Any, *, compression: CompressorSpec | None = None, local_window: int = 16,
                 n_ctx: int | None = None, seed: int = 0) -> CompressedConfig:
    """The :class:`CompressedConfig` of a transformers ``Qwen3Config`` (or its dict), with optional compression.

    Args:
        hf_config: a ``Qwen3Config`` or the ``config.json`` dict.
        compression: the compressor of every layer (``None``: Qwen3 itself, full attention).
        local_window: raw tokens each query of a compressed layer sees exactly.
        n_ctx: context length (default the config's ``max_position_embeddings``).
    """
    if _get(hf_config, "attention_bias", False):
        raise ConfigError("this Qwen3 config has attention biases (attention_bias=True); phaselens's attention has "
                          "none. Use a config with attention_bias=False (every released Qwen3 has it).")
    if _get(hf_config, "use_sliding_window", False):
        raise ConfigError("this Qwen3 config uses sliding-window layers (use_sliding_window=True); convert one without.")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"Qwen3 hidden_act {_get(hf_config, 'hidden_act')!r} is not supported; only 'silu' is.")
    n_heads = int(_get(hf_config, "num_attention_heads"))
    return CompressedConfig(
        n_layers=int(_get(hf_config, "num_hidden_layers")),
        d_model=int(_get(hf_config, "hidden_size")),
        n_heads=n_heads,
        n_kv_heads=int(_get(hf_config, "num_key_value_heads") or n_heads),
        d_head=int(_get(hf_config, "head_dim") or _get(hf_config, "hidden_size") // n_heads),
        d_mlp=int(_get(hf_config, "intermediate_size")),
        d_vocab=int(_get(hf_config, "vocab_size")),
        n_ctx=int(n_ctx or _get(hf_config, "max_position_embeddings")),
        local_window=local_window,
        sink=False,
        compression=compression,
        rope=RopeSpec(theta=_rope_theta(hf_config), style="half"),
        norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        init_std=float(_get(hf_config, "initializer_range", 0.02)),
        seed=seed,
        qk_norm=True,
        mlp="swiglu",
        mlp_bias=False,
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )


def is_qwen3_like(cfg: CompressedConfig) -> bool:
    """Whether ``cfg`` has the Qwen3 backbone (so :func:`to_qwen3` can write it when it does not compress)."""
    return (cfg.qk_norm and cfg.mlp == "swiglu" and not cfg.mlp_bias and not cfg.sink and cfg.rope is not None
            and cfg.rope.style == "half" and cfg.rope.dims in (None, cfg.d_head) and cfg.rope.yarn is None)


def _pairs(cfg: CompressedConfig) -> list[tuple[str, str, bool]]:
    """``(transformers name, phaselens name, transposed)`` of every stored tensor."""
    out = [("model.embed_tokens.weight", "embed.weight", False), ("model.norm.weight", "ln_final.weight", False)]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", "unembed.weight", False))
    for i in range(cfg.n_layers):
        hf, pl = f"model.layers.{i}.", f"blocks.{i}."
        out += [
            (hf + "input_layernorm.weight", pl + "ln1.weight", False),
            (hf + "post_attention_layernorm.weight", pl + "ln2.weight", False),
            (hf + "self_attn.q_norm.weight", pl + "attn.q_norm", False),
            (hf + "self_attn.k_norm.weight", pl + "attn.k_norm", False),
            (hf + "mlp.gate_proj.weight", pl + "mlp.W_gate", True),
            (hf + "mlp.up_proj.weight", pl + "mlp.W_in", True),
            (hf + "mlp.down_proj.weight", pl + "mlp.W_out", True),
            (hf + "self_attn.o_proj.weight", pl + "attn.W_O", True),
            (hf + "self_attn.q_proj.weight", pl + "attn.W_Q", True),
            (hf + "self_attn.k_proj.weight", pl + "attn.W_K", True),
            (hf + "self_attn.v_proj.weight", pl + "attn.W_V", True),
        ]
    return out


def from_qwen3(hf_model: Any, *, compression: CompressorSpec | None = None, local_window: int = 16,
               n_ctx: int | None = None) -> CompressedTransformer:
    """A :class:`CompressedTransformer` with the weights of a transformers ``Qwen3ForCausalLM`` (fp32, CPU).

    With ``compression`` the shared weights are copied and the compressors keep their fresh initialisation
    (e.g. to start the paper's family from a released Qwen3); K = V tied compressors are refused (no ``W_K``).
    """
    cfg = qwen3_config(hf_model.config, compression=compression, local_window=local_window, n_ctx=n_ctx)
    if compression is not None and compression.tied_kv:
        raise ConfigError("from_qwen3 copies W_K and W_V, which tied K=V compressed layers do not have; use "
                          "tied_kv=False.")
    model = CompressedTransformer(cfg)
    theirs = hf_model.state_dict()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf_name, name, transposed in _pairs(cfg):
            w = theirs[hf_name].detach().float()
            params[name].copy_(w.T if transposed else w)
    return model


def to_qwen3(model: CompressedTransformer) -> Any:
    """A transformers ``Qwen3ForCausalLM`` (fp32, eager attention) with ``model``'s weights.

    Only for a model with the Qwen3 backbone and no compression (the family's full-attention control).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    if cfg.compression is not None or not is_qwen3_like(cfg):
        raise ConfigError("to_qwen3 writes a full-attention model with the Qwen3 backbone (qk_norm, swiglu, no "
                          "biases, no sink, a 'half' RoPE over the whole head); this model is not one.")
    assert cfg.rope is not None
    hf_cfg = Qwen3Config(
        vocab_size=cfg.d_vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_mlp,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_key_value_heads,
        head_dim=cfg.d_head, max_position_embeddings=cfg.n_ctx, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope.theta}, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, attn_implementation="eager",
    )
    hf = Qwen3ForCausalLM(hf_cfg).float().eval()
    ours = dict(model.named_parameters())
    state = {hf_name: (ours[name].T if transposed else ours[name]).detach().float().contiguous()
             for hf_name, name, transposed in _pairs(cfg)}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf
