"""Run DeepSeek's reference V4 ``inference/model.py`` on a CPU, next to a transformers model with the same weights.

phaselens vendors none of DeepSeek's code. The user points :func:`import_reference` at a local directory that
holds the reference ``model.py`` (DeepSeek-V4-Flash's ``inference/`` folder, or a byte-identical copy); its
``kernel.py`` is not imported (TileLang, CUDA only). Instead the names ``model.py`` imports from it are the
CPU emulations in ``tests/support/deepseek_reference.py``, chosen per run by :func:`use_kernels`:

* ``quant``: ``"none"`` (no rounding; what the adapter computes with ``quantize=None``), ``"published"``
  (the simulation as ``kernel.py`` is written: ``act_quant(inplace=True)`` casts through the input's bf16, so
  it changes nothing, and ``fp4_act_quant`` rounds the indexer's q and k through FP4) or ``"e4m3"`` (the
  same, with the FP8 steps rounding through e4m3 as an FP8 KV cache or FP8 kernel does);
* ``block`` / ``round_probs``: the online softmax of ``sparse_attn`` over blocks of 64 keys with bf16
  probabilities (as written), over blocks of 8, or with the probabilities kept in fp32: legitimate
  emulations of one kernel, whose differences are the floor of any comparison.

:func:`reference_weights` renames a transformers ``DeepseekV4ForCausalLM``'s tensors to the reference's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.support import deepseek_reference as emu

MODULE = "deepseek_v4_reference_model"


def _no_weight_quant(*_a: Any, **_k: Any) -> None:
    raise NotImplementedError("FP8 / FP4 weights are not emulated: build the reference with dtype='bf16'.")


def _act_quant(through: Any, x: torch.Tensor, block_size: int = 128, scale_fmt: Any = None,
               scale_dtype: Any = None, inplace: bool = False) -> torch.Tensor:
    if not inplace:
        _no_weight_quant()
    if through == "none":
        return x
    x.copy_(emu.act_quant_emulated(x, block_size, through=through))
    return x


def _fp4_act_quant(enabled: bool, x: torch.Tensor, block_size: int = 32, inplace: bool = False) -> torch.Tensor:
    if not inplace:
        _no_weight_quant()
    if enabled:
        x.copy_(emu.fp4_quant_emulated(x, block_size))
    return x


def import_reference(directory: str | Path) -> types.ModuleType:
    """Import ``directory/model.py`` with emulated kernels standing in for ``kernel.py``."""
    path = Path(directory) / "model.py"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: point --reference at DeepSeek-V4's inference/ directory.")
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    kernel = types.ModuleType("kernel")  # the names model.py imports; use_kernels sets the real ones
    for name in ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn"):
        setattr(kernel, name, _no_weight_quant)
    hadamard = types.ModuleType("fast_hadamard_transform")
    hadamard.hadamard_transform = emu.hadamard_emulated
    saved = sys.modules.get("kernel")
    # rotate_activation imports fast_hadamard_transform at each call, so its stand-in stays registered
    sys.modules.update(kernel=kernel, fast_hadamard_transform=hadamard)
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("kernel", None)
        else:
            sys.modules["kernel"] = saved
    sys.modules[MODULE] = module
    return module


def use_kernels(ref: types.ModuleType, *, quant: str = "published", block: int = 64, round_probs: bool = True,
                fp32: bool = False, record: list | None = None) -> None:
    """Set the kernel emulations the imported reference calls (see the module docstring).

    ``fp32``: the reference's ``rotate_activation`` asserts bf16; for an fp32 run the rotation is done in
    fp32 instead (it is orthogonal, so without FP4 it leaves the indexer's scores as they are).
    ``record``: a list that receives ``(q, kv, sink, idx, scale, out)`` of every ``sparse_attn`` call.
    """
    through = {"none": "none", "published": None, "e4m3": torch.float8_e4m3fn}[quant]
    ref.act_quant = partial(_act_quant, through)
    ref.fp4_act_quant = partial(_fp4_act_quant, quant != "none")

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
        out = emu.sparse_attn_emulated(q, kv, attn_sink, topk_idxs, softmax_scale, block=block,
                                       round_probs=round_probs and not fp32)
        if record is not None:
            record.append(tuple(t.clone() if torch.is_tensor(t) else t
                                for t in (q, kv, attn_sink, topk_idxs, softmax_scale, out)))
        return out

    ref.sparse_attn = sparse_attn
    ref.hc_split_sinkhorn = emu.hc_split_sinkhorn_emulated
    if fp32:
        ref.rotate_activation = lambda x: emu.hadamard_emulated(x, x.size(-1) ** -0.5)


def model_args(ref: types.ModuleType, config: Any, *, tokens: int, batch: int) -> Any:
    """The reference's ``ModelArgs`` for a transformers ``DeepseekV4Config`` (bf16 weights, ue8m0 scales)."""
    ratio = {"sliding_attention": 0, **{k: int(v) for k, v in config.compress_rates.items()}}
    compress = config.rope_parameters["compress"]
    return ref.ModelArgs(
        max_batch_size=batch, max_seq_len=tokens, dtype="bf16", scale_fmt="ue8m0", scale_dtype="fp32",
        vocab_size=config.vocab_size, dim=config.hidden_size, moe_inter_dim=config.moe_intermediate_size,
        n_layers=config.num_hidden_layers, n_hash_layers=config.mlp_layer_types.count("hash_moe"),
        n_mtp_layers=0, n_heads=config.num_attention_heads, n_routed_experts=config.n_routed_experts,
        n_shared_experts=1, n_activated_experts=config.num_experts_per_tok, score_func=config.scoring_func,
        route_scale=config.routed_scaling_factor, swiglu_limit=config.swiglu_limit,
        q_lora_rank=config.q_lora_rank, head_dim=config.head_dim, rope_head_dim=config.qk_rope_head_dim,
        norm_eps=config.rms_norm_eps, o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
        window_size=config.sliding_window, compress_ratios=tuple(ratio[t] for t in config.layer_types),
        compress_rope_theta=compress["rope_theta"], original_seq_len=compress["original_max_position_embeddings"],
        rope_theta=config.rope_parameters["main"]["rope_theta"], rope_factor=compress["factor"],
        beta_fast=compress.get("beta_fast", 32), beta_slow=compress.get("beta_slow", 1),
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim, index_topk=config.index_topk,
        hc_mult=config.hc_mult, hc_sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps,
    )


def reference_weights(hf: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a transformers ``DeepseekV4ForCausalLM`` under the reference's names."""
    out: dict[str, torch.Tensor] = {}
    sd = hf.state_dict()
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale", "lm_head.weight": "head.weight"}
    per_layer = {
        "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
        "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
        "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
        "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
        "self_attn.o_b_proj.weight": "attn.wo_b.weight", "self_attn.sinks": "attn.attn_sink",
        "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
        "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
        "self_attn.compressor.position_bias": "attn.compressor.ape",
        "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
        "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
        "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
        "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
        "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
        "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
        "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
        "mlp.gate.tid2eid": "ffn.gate.tid2eid",
        "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
        "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
        "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    }
    for key, value in sd.items():
        if key in top:
            out[top[key]] = value
            continue
        _, _, i, rest = key.split(".", 3)
        if rest in per_layer:
            out[f"layers.{i}.{per_layer[rest]}"] = value.int() if rest.endswith("tid2eid") else value
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)  # [E, 2I, D]: gate rows first
            for e in range(value.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = gate[e]
                out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = up[e]
        elif rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = value[e]
        else:
            raise KeyError(f"no reference name for {key}")
    return out


def build_reference(ref: types.ModuleType, hf: nn.Module, *, tokens: int, batch: int, fp32: bool) -> nn.Module:
    """The reference ``Transformer`` with ``hf``'s weights; bf16 as the reference runs, or all fp32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if fp32 else torch.bfloat16)
    try:
        model = ref.Transformer(model_args(ref, hf.config, tokens=tokens, batch=batch))
    finally:
        torch.set_default_dtype(previous)
    if fp32:
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
    state = model.state_dict()
    weights = reference_weights(hf)
    missing = sorted(set(state) - set(weights) - {k for k in state if k.endswith("freqs_cis")})
    if missing:
        raise KeyError(f"the transformers model has no tensors for the reference's {missing[:5]}")
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in weights.items()}, strict=False)
    return model.eval()


def reference_run(model: nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    """One reference forward: ``logits`` ``[B, T, V]`` at every position (its ``forward`` returns the last
    only), ``streams`` after each block ``[B, T, hc, D]``, and the indexers' ``picks`` ``{layer: [B, T, k]}``
    as entry indices (-1 = none)."""
    streams: list[torch.Tensor] = []
    final: list[torch.Tensor] = []
    picks: dict[int, torch.Tensor] = {}

    def keep_picks(i: int):
        def hook(_m, args, out):
            offset = args[3]
            picks[i] = torch.where(out >= 0, out - offset, out).long()
        return hook

    handles = [b.register_forward_hook(lambda _m, _a, out: streams.append(out.clone())) for b in model.layers]
    handles += [b.attn.indexer.register_forward_hook(keep_picks(i)) for i, b in enumerate(model.layers)
                if b.attn.compress_ratio and b.attn.indexer is not None]
    handles.append(model.head.register_forward_pre_hook(lambda _m, args: final.append(args[0].clone())))
    try:
        model(tokens, 0)
    finally:
        for h in handles:
            h.remove()
    return {"logits": head_logits(model, final[0]), "streams": streams, "picks": picks}


@torch.inference_mode()
def head_logits(model: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """The reference head's logits ``[B, T, V]`` at every position from its input streams ``[B, T, hc, D]``."""
    head = model.head
    x = model.norm(head.hc_head(streams, model.hc_head_fn, model.hc_head_scale, model.hc_head_base))
    B, T, D = x.shape
    return head.get_logits(x.reshape(B * T, 1, D)).view(B, T, -1)  # get_logits keeps position -1 of each row
