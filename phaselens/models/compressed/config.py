"""Frozen configuration of a :class:`~phaselens.models.compressed.transformer.CompressedTransformer`.

Everything here round-trips through JSON (``to_dict`` / ``from_dict``); an unknown key is an error,
so a checkpoint written by a newer phaselens never loads silently wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from phaselens.core.checks import MAX_SEED
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import ConfigError
from phaselens.models.compressed.json_fields import check_number, check_types, fields_from_json
from phaselens.models.parts.rope import RopeStyle, inverse_frequencies

GateKind = Literal["scalar", "vector", "uniform"]
Sharing = Literal["shared", "per_offset"]
MlpKind = Literal["gelu", "swiglu"]

# Fields added after checkpoints were first written: ``to_dict`` leaves them out at their default, so every
# config written before they existed (the zoo's, run fingerprints) stays byte-identical.
_LATER_DEFAULTS: dict[str, Any] = {"qk_norm": False, "mlp": "gelu", "mlp_bias": True, "tie_embeddings": False}


@dataclass(frozen=True)
class YarnSpec:
    """YaRN frequency scaling of a RoPE (no magnitude scaling unless ``attention_factor`` is set)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            check_number("YarnSpec", name, getattr(self, name))
        if not isinstance(self.original_max_position, int) or isinstance(self.original_max_position, bool) \
                or self.original_max_position < 1:
            raise ConfigError(f"YarnSpec.original_max_position must be a positive int, got {self.original_max_position!r}.")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of the trailing channels of each head.

    Args:
        dims: how many *trailing* channels of each head rotate (even); ``None`` rotates all of them.
        theta: the base.
        yarn: optional YaRN frequency scaling.
        style: ``"interleaved"`` pairs ``(x[..., 2i], x[..., 2i + 1])`` (DeepSeek-V4); ``"half"`` pairs
            ``(x[..., i], x[..., i + dims/2])`` (Qwen3 and Llama as transformers implements them).
    """

    dims: int | None = None
    theta: float = 10000.0
    yarn: YarnSpec | None = None
    style: RopeStyle = "interleaved"

    def __post_init__(self) -> None:
        check_types(self)
        check_number("RopeSpec", "theta", self.theta)

    def inv_freq(self, d_head: int) -> Float[Tensor, " pairs"]:
        """Inverse frequencies ``[dims // 2]`` (fp32) over the ``dims`` rotated channels of a ``d_head`` head
        (all of them when ``dims`` is None), with the YaRN scaling if any (its magnitude scale
        ``yarn.attention_factor`` is the caller's, at rotation)."""
        dims = d_head if self.dims is None else self.dims
        yarn = self.yarn
        if yarn is None:
            return inverse_frequencies(dims, self.theta)
        return inverse_frequencies(dims, self.theta, factor=yarn.factor, original=yarn.original_max_position,
                                   beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)


@dataclass(frozen=True)
class CompressorSpec:
    """How a compressed layer pools ``window`` slots into one entry every ``stride`` slots.

    Args:
        stride: S.
        window: W, a multiple of S (default S). ``W = 2S`` with ``overlap_split`` is DeepSeek-V4 CSA.
        gate: ``"scalar"`` (one logit per slot and KV head), ``"vector"`` (one per channel, as DeepSeek) or
            ``"uniform"`` (mean pooling, no gate parameters).
        gate_params: ``"shared"`` (one gate projection for every slot) or ``"per_offset"`` (one per slot).
        position_bias: add a learned per-offset bias to the gate logits (DeepSeek's ``position_bias``).
        payload: ``"shared"`` or ``"per_offset"`` payload projection of the compressor's own, or ``"attention"``:
            pool the layer's own raw keys and values (after the QK-norm, before RoPE), so entries are convex
            mixtures of the keys and values the local window sees and the compressor adds only its gates.
        tied_kv: keys and values are one latent (K = V), as in DeepSeek-V4. The layer's raw tokens then
            share one projection too, and the RoPE carried by the values is undone at the query position.
        norm: RMSNorm on the pooled rows.
        rope: ``"inherit"`` (the model's RoPE), ``"none"``, or an explicit :class:`RopeSpec` for entries.
            Entries rotate at the first slot of their own stride block.
        overlap_split: the DeepSeek-V4 CSA layout: projections give ``W/S`` channel groups per token, and slot
            group g of entry j takes group g of block ``j - (W/S - 1) + g``. Requires ``window > stride``.
    """

    stride: int
    window: int | None = None
    gate: GateKind = "scalar"
    gate_params: Sharing = "shared"
    position_bias: bool = True
    payload: Literal["shared", "per_offset", "attention"] = "shared"
    tied_kv: bool = False
    norm: bool = False
    rope: Literal["inherit", "none"] | RopeSpec = "inherit"
    overlap_split: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        spec = PhaseSpec(self.stride, self.window)  # validates stride and window
        check_types(self)
        check_number("CompressorSpec", "norm_eps", self.norm_eps)
        object.__setattr__(self, "window", spec.window)
        if self.payload == "attention" and self.overlap_split:
            raise ConfigError("payload='attention' pools the layer's own keys and values, which have no channel groups "
                              "for overlap_split; use overlap_split=False (plain overlapping windows) or payload='shared'.")
        if self.overlap_split and self.window == self.stride:
            raise ConfigError(
                "overlap_split needs overlapping windows: set window to a multiple of the stride above it, "
                f"e.g. window={2 * self.stride}."
            )
        if self.gate == "uniform" and (self.position_bias or self.gate_params != "shared"):
            raise ConfigError(
                "uniform gates have no parameters: use position_bias=False and gate_params='shared' with gate='uniform'."
            )

    @property
    def phase_spec(self) -> PhaseSpec:
        return PhaseSpec(self.stride, self.window)

    @property
    def blocks_per_window(self) -> int:
        assert self.window is not None
        return self.window // self.stride


@dataclass(frozen=True)
class CompressedConfig:
    """Sizes and layout of a compressed-cache decoder.

    ``compression=None`` gives the full-attention control with identical dimensions.

    Args:
        n_layers, d_model, n_heads, d_head, d_mlp, d_vocab: sizes.
        n_ctx: maximum context (cache slots).
        n_kv_heads: KV heads (GQA/MQA); defaults to ``n_heads``.
        local_window: raw tokens each query of a compressed layer sees exactly (itself included).
        sink: a learned per-head sink logit in every attention softmax.
        compressed_layers: which layers compress (default: all). Others use ``uncompressed_attention``.
        compression: the compressor of compressed layers, or ``None`` for full attention everywhere.
        rope: RoPE of queries and raw keys; ``None`` means no positional encoding at all.
        uncompressed_attention: ``"full"`` causal attention or ``"local"`` (sliding window only) in layers
            that do not compress.
        qk_norm: an RMSNorm over each head's channels on queries and raw keys, before RoPE (Qwen3).
        mlp: ``"gelu"`` (``W_out gelu(W_in x)``) or ``"swiglu"`` (``W_out (silu(W_gate x) * W_in x)``, Qwen3).
        mlp_bias: biases in the MLP (attention never has any).
        tie_embeddings: the unembedding is the embedding matrix (Qwen3-0.6B).
        device: where the model lives; runtime only, not saved.

    With ``qk_norm=True, mlp="swiglu", mlp_bias=False, tie_embeddings=True, sink=False``, a ``"half"`` RoPE
    and ``compression=None`` the model is Qwen3 (:mod:`phaselens.models.qwen3` converts weights both ways).
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    n_kv_heads: int | None = None
    local_window: int = 16
    sink: bool = True
    compressed_layers: tuple[int, ...] | None = None
    compression: CompressorSpec | None = None
    rope: RopeSpec | None = field(default_factory=RopeSpec)
    uncompressed_attention: Literal["full", "local"] = "full"
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0
    qk_norm: bool = False
    mlp: MlpKind = "gelu"
    mlp_bias: bool = True
    tie_embeddings: bool = False
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):  # a torch.device is a device too; stored as its string
            object.__setattr__(self, "device", str(self.device))
        for name in ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx", "local_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:  # True is an int, not a count
                raise ConfigError(f"{name} must be a positive int, got {value!r}.")
        if self.n_kv_heads is not None and (not isinstance(self.n_kv_heads, int) or isinstance(self.n_kv_heads, bool)):
            raise ConfigError(f"n_kv_heads must be a positive int or None, got {self.n_kv_heads!r}.")
        check_types(self)
        check_number("CompressedConfig", "norm_eps", self.norm_eps)
        check_number("CompressedConfig", "init_std", self.init_std, positive=False)
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an int in 0..{MAX_SEED:,} (2^63 - 1: torch's generators take 64 bits), "
                              f"got {self.seed!r}.")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        assert self.n_kv_heads is not None
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
                "use a divisor of n_heads (1 for MQA)."
            )
        if self.compressed_layers is not None:
            layers = tuple(sorted({int(i) for i in self.compressed_layers}))
            bad = [i for i in layers if not 0 <= i < self.n_layers]
            if bad:
                raise ConfigError(f"compressed_layers {bad} are outside 0..{self.n_layers - 1}.")
            object.__setattr__(self, "compressed_layers", layers)
        comp = self.compression
        if comp is not None and comp.tied_kv and isinstance(comp.rope, RopeSpec) and comp.rope != self.rope:
            raise ConfigError(
                "tied K=V entries carry RoPE into the values, which is undone at the query with the model's RoPE; "
                "use compression rope='inherit' (or 'none') with tied_kv=True."
            )
        for rope in self._ropes():
            dims = self.d_head if rope.dims is None else rope.dims
            if dims % 2 or not 0 < dims <= self.d_head:
                raise ConfigError(f"RoPE dims must be even and in 2..d_head={self.d_head}, got {rope.dims}.")

    def _ropes(self) -> list[RopeSpec]:
        out = [self.rope] if self.rope is not None else []
        if self.compression is not None and isinstance(self.compression.rope, RopeSpec):
            out.append(self.compression.rope)
        return out

    # ---- TransformerLens-compatible names ---------------------------------------------------------
    @property
    def n_key_value_heads(self) -> int:
        assert self.n_kv_heads is not None
        return self.n_kv_heads

    # What TransformerLens's cache methods read (accumulated_resid, decompose_resid, logit_attrs, apply_ln):
    # pre-norm RMSNorm blocks with attention and an MLP, rotary positions (nothing added to the embedding).
    normalization_type = "RMS"
    final_rms = True
    attn_only = False
    positional_embedding_type = "rotary"

    def layer_is_compressed(self, layer: int) -> bool:
        if self.compression is None:
            return False
        return self.compressed_layers is None or layer in self.compressed_layers

    def phase_specs(self) -> list[PhaseSpec | None]:
        """The geometry of every layer (``None`` where a layer does not compress)."""
        return [
            self.compression.phase_spec if self.layer_is_compressed(i) and self.compression else None
            for i in range(self.n_layers)
        ]

    # ---- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("device")
        for name, default in _LATER_DEFAULTS.items():
            if data[name] == default:
                data.pop(name)
        for rope in (data["rope"], (data["compression"] or {}).get("rope")):
            if isinstance(rope, dict) and rope["style"] == "interleaved":
                rope.pop("style")
        if data["compressed_layers"] is not None:
            data["compressed_layers"] = list(data["compressed_layers"])
        return data

    @classmethod
    def from_dict(cls, data: Any) -> CompressedConfig:
        """The config ``to_dict`` wrote (nested specs included), every field checked against its type first."""
        return cls(**fields_from_json(cls, data))
