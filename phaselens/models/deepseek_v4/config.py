"""``DeepSeekV4Cfg`` (TransformerLens-style names) and the checks that refuse models we cannot measure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from phaselens.errors import UnsupportedModelError
from phaselens.models.deepseek_v4.geometry import LayerGeometry, layer_geometry
from phaselens.models.parts.tl_habits import TLConfig


@dataclass(frozen=True, kw_only=True)
class DeepSeekV4Cfg(TLConfig):
    """Sizes of a DeepSeek-V4 model under the names phaselens analyses use (a
    :class:`~phaselens.models.parts.tl_habits.TLConfig` plus V4's own fields).

    ``n_key_value_heads`` is 1: V4 attention is multi-query with one latent that serves as key and value
    (``tied_kv``), so "L2KV0" means every query head of layer 2. ``local_window`` is the sliding window
    every layer attends raw (``config.sliding_window``). ``hc_mult`` is the number of hyper-connection
    residual copies: residual hooks are ``[B, n, hc_mult, d_model]``.
    """

    hc_mult: int
    local_window: int
    o_groups: int
    q_lora_rank: int
    rope_dims: int
    index_topk: int
    index_n_heads: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int] = field(default_factory=dict)
    n_key_value_heads: int = 1
    tied_kv: bool = True
    model_name: str = "deepseek_v4"
    attn_implementation: str = "eager"

    @property
    def d_mlp(self) -> None:
        """V4's MLPs are mixtures of experts; there is no single ``d_mlp``."""
        return None


def unwrap(model: Any) -> tuple[nn.Module, Any]:
    """``(hf_model, envoy)``: accept a transformers model or an nnsight envoy wrapping one.

    Detected by the wrapper's module, never by ``hasattr(x, "save")`` (nnsight mounts ``.save`` on every
    object once imported).
    """
    if type(model).__module__.startswith("nnsight") and isinstance(
        getattr(model, "_module", None), nn.Module
    ):
        return model._module, model
    return model, None


def check_model(model: Any) -> list[LayerGeometry]:
    """Refuse what the adapter cannot measure faithfully; return the layer geometry otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or model_type != "deepseek_v4":
        raise UnsupportedModelError(
            f"phaselens.from_hf supports transformers' DeepSeek-V4 (model_type 'deepseek_v4'), got "
            f"{type(model).__name__} with model_type {model_type!r}. Phaselens' own models need no adapter; "
            "other HF architectures are not supported."
        )
    inner = getattr(model, "model", None)
    if getattr(model, "lm_head", None) is None or getattr(inner, "layers", None) is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no language-model head; pass DeepseekV4ForCausalLM "
            "(e.g. DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation='eager'))."
        )
    check_eager(config)
    geometry = layer_geometry(config)
    if not any(g.compressed for g in geometry):
        raise UnsupportedModelError(
            "this DeepSeek-V4 model has no compressed layers (every layer_type is 'sliding_attention'), "
            "so it "
            "has no phase geometry to analyse; use a config whose layer_types include "
            "'compressed_sparse_attention' or 'heavily_compressed_attention'."
        )
    return geometry


def check_eager(config: Any) -> None:
    """Only transformers' own eager attention materialises the probabilities the adapter reads.

    Anything else is refused: another name (sdpa, flash, flex, a kernels-hub function, a dict of per-config
    implementations) or an ``"eager"`` that someone re-registered in transformers' attention registry.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(config, "_attn_implementation", None)
    if impl != "eager" or "eager" in ALL_ATTENTION_FUNCTIONS:
        what = (
            f"_attn_implementation={impl!r}"
            if impl != "eager"
            else "'eager' overridden in ALL_ATTENTION_FUNCTIONS"
        )
        raise UnsupportedModelError(
            f"the DeepSeek-V4 adapter needs transformers' eager attention, but the model has {what}. Load "
            "it with from_pretrained(path, attn_implementation='eager') or call "
            "model.set_attn_implementation('eager') "
            "(transformers 5.24 supports only eager for DeepSeek-V4)."
        )


def rope_dims(model: nn.Module, rope_type: str = "compress") -> int:
    """The number of trailing channels RoPE rotates, read from the model's rotary embedding (two per frequency).

    Not ``config.qk_rope_head_dim``: a config whose nested ``rope_parameters`` carry their own
    ``partial_rotary_factor`` rotates that many channels whatever ``qk_rope_head_dim`` says.
    """
    rotary = model.model.rotary_emb
    inv_freq = getattr(rotary, f"{rope_type}_inv_freq", None)
    if inv_freq is None:
        inv_freq = rotary.main_inv_freq
    return 2 * int(inv_freq.shape[-1])


def build_cfg(model: nn.Module, geometry: list[LayerGeometry]) -> DeepSeekV4Cfg:
    config = model.config
    embed = model.get_input_embeddings().weight
    return DeepSeekV4Cfg(
        n_layers=int(config.num_hidden_layers),
        n_heads=int(config.num_attention_heads),
        d_head=int(config.head_dim),
        d_model=int(config.hidden_size),
        d_vocab=int(config.vocab_size),
        n_ctx=int(config.max_position_embeddings),
        device=embed.device,
        hc_mult=int(config.hc_mult),
        local_window=int(config.sliding_window),
        o_groups=int(config.o_groups),
        q_lora_rank=int(config.q_lora_rank),
        rope_dims=rope_dims(model),
        index_topk=int(config.index_topk),
        index_n_heads=int(config.index_n_heads),
        dtype=embed.dtype,
        layer_types=tuple(g.layer_type for g in geometry),
        compress_rates={k: int(v) for k, v in dict(config.compress_rates).items()},
    )
