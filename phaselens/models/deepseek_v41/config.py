"""``V41Config``: the text model of a DeepSeek-V4.1 checkpoint, read from ``config.json`` (``text_config``).

Facts checked against DeepSeek's reference ``inference/model.py`` (revision dba1be0a of DeepSeek-V4.1-Flash):

* ``compress_ratios`` has one entry per layer *including* the draft (DSpark / next-token-prediction) layers
  appended after the backbone; only the first ``num_hidden_layers`` belong to the text model.
* ratio 0: sliding window only; ratio ``r >= 2``: ``r`` tokens pooled into one entry by a softmax gate (no
  overlap, no position bias); ratio 1: one normed projection per token (no gate).
* only ``kv_source_layer_ids`` compute compressed KV; every other compressed layer reads the cache of the
  latest source at or before it. Only ``index_source_layer_ids`` run an indexer; the others reuse the picks
  of the latest index source. Index keys are produced at KV sources only.
* ``candidate_source_layer_id`` (``-1``: off) publishes a block mask that later index sources apply.
* ``engram_*``: the Engram n-gram lookups added to the streams before the layers in ``engram_layer_ids``
  (:mod:`.engram`); ``engram_num_embeddings`` has one table size per Engram layer. The pad token is
  ``engram_pad_token_id`` in the Hugging Face config (``engram_pad_id`` in the reference's own config).

:meth:`V41Config.topology` turns those lists into per-layer roles and refuses configs the reference would
compute something ill-defined for (see ``docs/deepseek_v41.md``).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from phaselens.errors import CheckpointError, UnsupportedModelError
from phaselens.models.parts import config_fields as rules
from phaselens.models.parts.config_fields import spans


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer computes and where it reads shared state from.

    ``kv_source`` / ``index_source`` are the layers whose compressed KV and indexer picks this layer uses
    (itself when it is a source; ``None`` for sliding layers).
    """

    layer: int
    ratio: int
    kv_source: int | None
    index_source: int | None
    is_kv_source: bool
    is_index_source: bool
    is_candidate_source: bool
    uses_candidates: bool

    @property
    def compressed(self) -> bool:
        return self.ratio > 0


# how a ``text_config`` value becomes a field of :class:`V41Config`, by the field's annotation
_READ = {"int": int, "float": float, "bool": bool, "str": str,
         "tuple[int, ...]": lambda v: tuple(int(x) for x in v or ())}


@dataclass(frozen=True)
class V41Config:
    """The text model's hyperparameters (names follow ``text_config``; see the module docstring)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 1.0
    rope_original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1 << 20
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    gate_temp: float = 1.0
    swiglu_limit: float = 0.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0
    weight_block_size: tuple[int, int] = (32, 32)
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- parsing -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "") -> V41Config:
        """Parse a ``config.json`` dict: ``model_type`` ``deepseek_v41`` with the text model in ``text_config``."""
        if raw.get("model_type") != "deepseek_v41":
            raise UnsupportedModelError(
                f"config.json has model_type {raw.get('model_type')!r}; this loader reads DeepSeek-V4.1 "
                "('deepseek_v41') checkpoints."
            )
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(
                "config.json of a DeepSeek-V4.1 checkpoint must hold the text model under 'text_config' "
                "(a dict); this one has none."
            )
        need = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in need if k not in text]
        if missing:
            raise CheckpointError(f"config.json text_config lacks {missing}; the checkpoint is incomplete.")
        check_v41_fields(raw, name=name)  # every field's type and range, before any int() or tensor shape
        kv_heads = int(text.get("num_key_value_heads", 1))
        if kv_heads != 1:
            raise UnsupportedModelError(
                f"num_key_value_heads={kv_heads}: DeepSeek-V4.1 attends over one shared K = V latent (1)."
            )
        rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
        yarn = rope.get("rope_type", rope.get("type")) == "yarn"
        quant = quantization(raw)
        block = tuple(int(b) for b in quant.get("weight_block_size", (32, 32)))
        n = int(text["num_hidden_layers"])
        ratios = tuple(int(r) for r in text["compress_ratios"])
        if len(ratios) < n:
            raise CheckpointError(
                f"compress_ratios has {len(ratios)} entries for {n} layers; it needs one per layer."
            )
        # every field named as in text_config, absent ones at their defaults; then those read from elsewhere
        read = [f for f in fields(cls) if f.type in _READ and f.name in text]
        values = {f.name: _READ[f.type](text[f.name]) for f in read}
        cfg = cls(**{
            **values,
            "compress_ratios": ratios[:n],
            "rope_factor": float(rope.get("factor", 1.0)) if yarn else 1.0,
            "rope_original_max_position": int(rope.get("original_max_position_embeddings", 0)) if yarn else 0,
            "beta_fast": float(rope.get("beta_fast", 32)),
            "beta_slow": float(rope.get("beta_slow", 1)),
            "engram_pad_id": int(text.get("engram_pad_token_id", text.get("engram_pad_id", 2))),
            "weight_block_size": (int(block[0]), int(block[-1])),
            "name": name,
            "extra": {"text_config": text, "quantization_config": quant},
        })
        cfg.topology()  # validate now: a bad config fails at load, not mid-forward
        return cfg

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def n_heads(self) -> int:
        return self.num_attention_heads

    @property
    def candidates_on(self) -> bool:
        return self.candidate_source_layer_id >= 0

    def topology(self) -> list[LayerRole]:
        """Per-layer roles (raises :class:`UnsupportedModelError` on a sharing map the reference cannot run)."""
        n = self.num_hidden_layers
        kv_src, idx_src = set(self.kv_source_layer_ids), set(self.index_source_layer_ids)
        valid = [i for i in range(n) if self.compress_ratios[i] != 0]
        for key, listed in (("kv_source_layer_ids", kv_src), ("index_source_layer_ids", idx_src)):
            bad = sorted(i for i in listed if i not in set(valid))
            if bad:
                raise UnsupportedModelError(
                    f"text_config.{key} lists layers {bad}, which are not compressed backbone layers; a source "
                    f"must be one of layers {spans(valid) or '(none: no layer is compressed)'}, the layers in "
                    f"0..{n - 1} (num_hidden_layers={n}) whose compress_ratios entry is not 0 (compress_ratios "
                    f"{list(self.compress_ratios)})."
                )
        if self.candidates_on:
            c = self.candidate_source_layer_id
            if c not in idx_src:
                raise UnsupportedModelError(f"candidate_source_layer_id {c} is not an index source.")
            if self.candidate_block_size < 1 or (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1 < self.index_topk:
                # fewer kept entries than picks: the reference then picks among -inf scores, an order torch
                # leaves unspecified, and such picks can land outside the candidate blocks
                raise UnsupportedModelError(
                    f"candidate_topk_blocks={self.candidate_topk_blocks} x candidate_block_size="
                    f"{self.candidate_block_size} can keep fewer entries than index_topk={self.index_topk}; "
                    "the reference's picks are then ill-defined (see docs/deepseek_v41.md)."
                )
        roles: list[LayerRole] = []
        kv_cur: int | None = None
        idx_cur: int | None = None
        for layer in range(n):
            r = self.compress_ratios[layer]
            if layer in kv_src:
                kv_cur = layer
            if layer in idx_src:
                idx_cur = layer
            if r == 0:
                roles.append(LayerRole(layer, 0, None, None, False, False, False, False))
                continue
            if kv_cur is None or self.compress_ratios[kv_cur] != r:
                raise UnsupportedModelError(
                    f"layer {layer} (ratio {r}) would read the compressed KV of "
                    f"{'no source' if kv_cur is None else f'layer {kv_cur} (ratio {self.compress_ratios[kv_cur]})'};"
                    " every compressed layer needs an earlier KV source of its own ratio."
                )
            if idx_cur is None or idx_cur < kv_cur:
                raise UnsupportedModelError(
                    f"layer {layer} would reuse indexer picks of {'no layer' if idx_cur is None else idx_cur}, "
                    f"made over another source's entries than its KV source {kv_cur}; every KV source must "
                    "also be an index source."
                )
            cand = self.candidates_on and layer == self.candidate_source_layer_id
            uses = self.candidates_on and layer in idx_src and 0 <= self.candidate_source_layer_id < layer
            roles.append(LayerRole(layer, r, kv_cur, idx_cur, layer in kv_src, layer in idx_src, cand, uses))
        return roles


# ---- the fields' checks: load and ``phaselens plan`` both go through :meth:`V41Config.from_dict` -----------
POSITIVE_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "index_n_heads",
                "index_head_dim", "index_topk", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings", "engram_max_ngram_size")
NON_NEGATIVE_INT = ("qk_rope_head_dim", "n_shared_experts", "candidate_topk_blocks", "candidate_block_size",
                    "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_token_id", "engram_pad_id",
                    "engram_compressed_vocab_size", "num_nextn_predict_layers")
POSITIVE_FLOAT = ("rms_norm_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor", "gate_temp", "hc_eps")
NON_NEGATIVE_FLOAT = ("swiglu_limit",)
INT_LISTS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids")
SCALE_FORMATS = ("ue8m0",)  # DeepSeek's release: UE8M0 scales


def _quant_raw(raw: dict[str, Any]) -> Any:
    """``quantization_config`` as the file holds it: at the top level, else in ``text_config``."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    quant = raw.get("quantization_config")
    return quant if quant is not None else text.get("quantization_config")


def quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` (``{}``: none, the weights are stored dense)."""
    quant = _quant_raw(raw)
    return quant if isinstance(quant, dict) else {}


def field_problems(raw: dict[str, Any]) -> list[str]:
    """What is wrong with the fields of a V4.1 ``config.json`` (a dict), one phrase per field."""
    text: dict[str, Any] = raw.get("text_config") or {}
    out = rules.field_type_problems(text, positive_int=POSITIVE_INT, non_negative_int=NON_NEGATIVE_INT,
                                    positive_float=POSITIVE_FLOAT, non_negative_float=NON_NEGATIVE_FLOAT,
                                    bools=("norm_topk_prob",), non_negative_int_lists=INT_LISTS,
                                    positive_int_lists=("engram_num_embeddings",), prefix="text_config.")
    c = text.get("candidate_source_layer_id", -1)
    if not (rules.is_int(c) and c >= -1):
        out.append(f"text_config.candidate_source_layer_id must be a layer index or -1 (off), got {c!r}")
    for k, known in (("scoring_func", rules.SCORING), ("hidden_act", ("silu",)), ("topk_method", ("noaux_tc",))):
        if text.get(k, known[0]) not in known:  # what the V4.1 code computes, never silently another
            out.append(f"text_config.{k} must be one of {known}, got {text[k]!r}")
    out += rules.size_problems(text, (*POSITIVE_INT, *NON_NEGATIVE_INT), "text_config.",
                         ("engram_num_embeddings", "compress_ratios"))
    out += _rope_problems(text.get("rope_scaling") or text.get("rope_parameters"))
    out += _quant_problems(raw, text)
    if out:
        return out
    heads, groups, d, rope = (text[k] for k in ("num_attention_heads", "o_groups", "head_dim", "qk_rope_head_dim"))
    if heads % groups:
        out.append(f"text_config.o_groups={groups} must divide num_attention_heads={heads}")
    if text["num_experts_per_tok"] > text["n_routed_experts"]:
        out.append(f"text_config.num_experts_per_tok={text['num_experts_per_tok']} exceeds "
                   f"n_routed_experts={text['n_routed_experts']}")
    if rope > d or rope % 2:
        out.append(f"text_config.qk_rope_head_dim={rope} must be even and at most head_dim={d}")
    return out


def _rope_problems(rope: Any) -> list[str]:
    if rope is None:
        return []
    if not isinstance(rope, dict):
        return [f"text_config.rope_scaling must be a JSON object or null, got {rope!r}"]
    out = [f"text_config.rope_scaling.{k} must be a finite number > 0, got {rope[k]!r}"
           for k in ("factor", "beta_fast", "beta_slow")
           if k in rope and not (rules.is_real(rope[k]) and rope[k] > 0)]
    m = rope.get("original_max_position_embeddings", 1)
    if not (rules.is_int(m) and m >= 1):
        out.append(f"text_config.rope_scaling.original_max_position_embeddings must be a positive integer, got {m!r}")
    return out


def _quant_problems(raw: dict[str, Any], text: dict[str, Any]) -> list[str]:
    """``quantization_config``: a format phaselens reads (never one it would plan or load as another)."""
    quant = _quant_raw(raw)
    if quant is None or quant == {}:
        return []
    experts = quant.get("expert_dtype", text.get("expert_dtype", "fp4")) if isinstance(quant, dict) else None
    return rules.quant_problems(quant, (("scale_fmt", SCALE_FORMATS, "ue8m0"),), experts=experts,
                                experts_key="quantization_config.expert_dtype", block_lengths=(1, 2))


def check_v41_fields(raw: dict[str, Any], *, name: str = "") -> None:
    """Raise :class:`CheckpointError` naming every bad field of a V4.1 ``config.json`` (what load and
    ``phaselens plan`` both refuse, with this one message)."""
    found = field_problems(raw)
    if found:
        where = f"config.json of {name}" if name else "config.json"
        raise CheckpointError(f"{where}: " + "; ".join(found) + ". Restore config.json from the checkpoint's "
                              "source (or fix the field).")
