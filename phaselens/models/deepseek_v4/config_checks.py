"""A DeepSeek-V4 ``config.json`` checked at phaselens's boundary, before transformers reads it.

transformers answers an edited config with errors from deep inside (a ``StrictDataclassFieldValidationError``,
``ZeroDivisionError``, "Trying to create tensor with negative dimension", ``KeyError: 'bogus'``), or loads it
and computes something else (a sliding window of -1, zero Sinkhorn iterations, a negative norm epsilon).
:func:`check_v4_config` names the field, what it must be and how to fix it. Sizes that agree with the
config but not with the weights are caught after loading, by tensor name and shape
(:func:`phaselens.storage.resumable.check_tensor_names` through :func:`phaselens.models.deepseek_v4.load_hf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phaselens.core.checks import MAX_DIM
from phaselens.errors import CheckpointError
from phaselens.models.parts import config_fields as rules

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")

POSITIVE_INT = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "sliding_window",
                "index_n_heads", "index_head_dim", "index_topk", "vocab_size", "hc_mult", "hc_sinkhorn_iters",
                "max_position_embeddings")
NON_NEGATIVE_INT = ("n_shared_experts", "num_nextn_predict_layers", "num_key_value_heads", "qk_rope_head_dim",
                    "num_hash_layers")
POSITIVE_FLOAT = ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor")
NON_NEGATIVE_FLOAT = ("swiglu_limit",)
BOOL = ("tie_word_embeddings", "norm_topk_prob", "attention_bias")


def problems(cfg: Mapping[str, Any]) -> list[str]:
    """What is wrong with a V4 config (a dict as ``config.json`` holds it), one phrase per field."""
    out = rules.field_type_problems(cfg, positive_int=POSITIVE_INT, non_negative_int=NON_NEGATIVE_INT)
    out += rules.size_problems(cfg, (*POSITIVE_INT, *NON_NEGATIVE_INT))
    out += rules.field_type_problems(cfg, positive_float=POSITIVE_FLOAT,
                                     non_negative_float=NON_NEGATIVE_FLOAT, bools=BOOL)
    prf = cfg.get("partial_rotary_factor")
    if prf is not None and not (rules.is_real(prf) and 0 < prf <= 1):
        out.append(f"partial_rotary_factor must be a number in (0, 1], got {prf!r}")
    if "hidden_act" in cfg:
        from transformers.activations import ACT2FN

        if not isinstance(cfg["hidden_act"], str) or cfg["hidden_act"] not in ACT2FN:
            out.append(f"hidden_act must name an activation such as 'silu', got {cfg['hidden_act']!r}")
    if "scoring_func" in cfg and cfg["scoring_func"] not in rules.SCORING:
        out.append(f"scoring_func must be one of {rules.SCORING}, got {cfg['scoring_func']!r}")
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) is not None and not _is_dtype(cfg[key]):
            out.append(f"{key} must name a torch dtype such as 'bfloat16', got {cfg[key]!r}")
    out += _schedules(cfg)
    out += _quantization(cfg)
    out += _rates(cfg.get("compress_rates"))
    rope_key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"  # the legacy name
    out += _rope(cfg.get(rope_key), rope_key)
    if not out:  # sizes that must agree with each other
        heads, groups = cfg.get("num_attention_heads"), cfg.get("o_groups")
        if rules.is_int(heads) and rules.is_int(groups) and heads % groups:
            out.append(f"o_groups={groups} must divide num_attention_heads={heads}")
        k, e = cfg.get("num_experts_per_tok"), cfg.get("n_routed_experts")
        if rules.is_int(k) and rules.is_int(e) and k > e:
            out.append(f"num_experts_per_tok={k} exceeds n_routed_experts={e}")
        d = cfg.get("head_dim")
        if rules.is_int(d) and prf is not None and (d * prf) % 2:
            out.append(f"head_dim x partial_rotary_factor = {d * prf:g} rotary channels must be an even integer")
    return out or _transformers_refuses(cfg)


def _transformers_refuses(cfg: Mapping[str, Any]) -> list[str]:
    """What transformers' ``DeepseekV4Config`` itself refuses among the fields not checked above (``use_cache``,
    ``bos_token_id``, ``initializer_range``, ...), as a phrase naming the field instead of its traceback."""
    import re
    import warnings

    from huggingface_hub.errors import StrictDataclassError
    from transformers import DeepseekV4Config

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "model_type")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DeepseekV4Config(**fields)
    except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError) as err:
        text = " ".join(str(err).split())
        field = re.search(r"field '(\w+)'", text)
        detail = text.split(": ", 1)[-1] if field else text
        return [f"{field[1] if field else 'a field'} is refused by transformers' DeepseekV4Config ({detail})"]
    return []


# the dtype names a config.json may hold (a closed table: a file's string never looks up an attribute)
_DTYPE_NAMES = frozenset({"float32", "float", "float16", "half", "bfloat16", "float64", "double",
                          "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int16", "int32", "int64", "bool"})


def _is_dtype(name: Any) -> bool:
    return isinstance(name, str) and name.removeprefix("torch.") in _DTYPE_NAMES


def _schedules(cfg: Mapping[str, Any]) -> list[str]:
    out = []
    n = cfg.get("num_hidden_layers")
    for key, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            out.append(f"{key} must be a list with one of {allowed} per layer, got {value!r}")
            continue
        bad = sorted({str(v) for v in value if v not in allowed})
        if bad:
            out.append(f"{key} holds {bad}; each entry must be one of {allowed}")
        elif rules.is_int(n) and len(value) != n:  # transformers needs exactly one per layer
            out.append(f"{key} lists {len(value)} layers but num_hidden_layers is {n}; give one entry per layer")
    ratios = cfg.get("compress_ratios")
    if ratios is not None and not (isinstance(ratios, list)
                                   and all(rules.is_int(r) and r in (0, 4, 128) for r in ratios)):
        out.append(f"compress_ratios must be a list of 0, 4 or 128 per layer, got {ratios!r}")
    return out


# what phaselens (through transformers' finegrained-fp8 integration) reads of quantization_config besides
# FP8 E4M3 weights: (key, known values, default)
SCALE_FORMATS = ("ue8m0", "float")
ACTIVATION_SCHEMES = ("dynamic", "static")
FORMATS = (("scale_fmt", SCALE_FORMATS, "float"), ("activation_scheme", ACTIVATION_SCHEMES, "dynamic"))


def _quantization(cfg: Mapping[str, Any]) -> list[str]:
    """``quantization_config`` (and the top-level ``expert_dtype`` the V4 releases carry): a format phaselens
    reads, never one it would plan or load as another."""
    quant = cfg.get("quantization_config")
    if hasattr(quant, "to_dict"):  # a transformers quantization config passed to load
        quant = quant.to_dict()
    inner = isinstance(quant, Mapping) and "expert_dtype" in quant
    experts = quant["expert_dtype"] if inner else cfg.get("expert_dtype")
    return rules.quant_problems(quant, FORMATS, experts=experts, block_lengths=(2,),
                                experts_key="quantization_config.expert_dtype" if inner else "expert_dtype")


def _rope(rope: Any, key: str = "rope_parameters") -> list[str]:
    """``rope_parameters``: null, or an object of per-path objects (``main``, ``compress``) whose ``rope_type``
    transformers knows."""
    if rope is None:
        return []
    if not isinstance(rope, dict):
        return [f"{key} must be a JSON object or null, got {rope!r}"]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ("default", *ROPE_INIT_FUNCTIONS)
    parts = rope.values() if all(isinstance(v, dict) for v in rope.values()) else [rope]
    bad = sorted({str(p.get("rope_type")) for p in parts if p.get("rope_type", "default") not in known})
    return [f"{key} names the rope_type {bad}; known types are {known}"] if bad else []


def _rates(rates: Any) -> list[str]:
    if rates is None:
        return []
    if not isinstance(rates, dict):
        return [f"compress_rates must be a JSON object such as {{'compressed_sparse_attention': 4, "
                f"'heavily_compressed_attention': 128}}, got {rates!r}"]
    out = []
    for k, v in rates.items():
        if k not in LAYER_TYPES[1:]:
            out.append(f"compress_rates has the unknown key {k!r}; keys are {LAYER_TYPES[1:]}")
        elif not (rules.is_int(v) and 2 <= v <= MAX_DIM):
            out.append(f"compress_rates[{k!r}] must be an integer >= 2 (tokens per compressed entry) and at most "
                       f"{MAX_DIM:,}, got {v!r}")
    return out


def check_v4_config(cfg: Mapping[str, Any], *, where: str, overrides: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`CheckpointError` naming every bad field of ``cfg`` (a ``config.json`` as a dict, with
    ``overrides`` passed to ``load`` applied), before transformers sees it."""
    merged = {**cfg, **{k: v for k, v in (overrides or {}).items() if k in cfg or k in _KNOWN}}
    found = problems(merged)
    if found:
        given = [k for k in (overrides or {}) if any(p.startswith(f"{k} ") or p.startswith(f"{k}[") for p in found)]
        fix = ("fix the argument(s) " + ", ".join(given) + " passed to load" if given else
               f"restore {where} from the checkpoint's source (or fix the field)")
        raise CheckpointError(f"{where}: " + "; ".join(found) + f". {fix[0].upper() + fix[1:]}.")


_KNOWN = frozenset((*POSITIVE_INT, *NON_NEGATIVE_INT, *POSITIVE_FLOAT, *NON_NEGATIVE_FLOAT, *BOOL, "hidden_act",
                    "scoring_func", "dtype", "torch_dtype", "layer_types", "mlp_layer_types", "compress_rates",
                    "compress_ratios", "partial_rotary_factor", "rope_parameters", "expert_dtype"))
