"""Op by op: each transformers op fed the reference's own input for it, its output against the reference's.

:func:`capture` runs the reference ``Transformer`` once and keeps, per block, the inputs and outputs of its
ops (attention sublayer, attention core, compressor, indexer, router, MoE, shared expert, the block itself)
and the input of the head. :func:`op_errors` then runs the transformers model's corresponding module on the
reference's input and measures the difference of the outputs. Differences therefore arise in that op alone,
not upstream. ``hc mixing`` runs a whole transformers decoder layer with its attention and MoE outputs replaced
by the reference's: what is left is the hyper-connections (``hc_pre`` / ``hc_post``) and the two norms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from phaselens.models.deepseek_v4 import reference_ops
from tests.support import deepseek_reference as emu


def rel(x: Tensor, ref: Tensor) -> float:
    """Relative Frobenius difference ``|x - ref| / |ref|`` (in float64)."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def capture(model: nn.Module, tokens: Tensor, record: list) -> dict[str, Any]:
    """One reference forward with hooks; ``record`` is the list :func:`loader.use_kernels` fills with the
    ``sparse_attn`` calls (one per block, in order)."""
    per: list[dict[str, Any]] = [{} for _ in model.layers]
    head: list[Tensor] = []
    handles = []

    def keep(i: int, name: str, inputs: bool = True):
        def hook(_m, args, out):
            per[i][name] = (tuple(a.clone() if torch.is_tensor(a) else a for a in args) if inputs else None,
                            out.clone() if torch.is_tensor(out) else tuple(o.clone() for o in out))
        return hook

    for i, block in enumerate(model.layers):
        handles.append(block.register_forward_pre_hook(lambda _m, a, i=i: per[i].__setitem__("in", a[0].clone())))
        handles.append(block.register_forward_hook(keep(i, "block", inputs=False)))
        handles.append(block.attn.register_forward_hook(keep(i, "attn")))
        handles.append(block.ffn.register_forward_hook(keep(i, "ffn")))
        handles.append(block.ffn.gate.register_forward_hook(keep(i, "gate")))
        handles.append(block.ffn.shared_experts.register_forward_hook(keep(i, "shared")))
        if block.attn.compress_ratio:
            handles.append(block.attn.compressor.register_forward_hook(keep(i, "compressor")))
            if block.attn.indexer is not None:
                handles.append(block.attn.indexer.register_forward_hook(keep(i, "indexer")))
    handles.append(model.head.register_forward_pre_hook(lambda _m, a: head.append(a[0].clone())))
    record.clear()
    try:
        model(tokens, 0)
    finally:
        for h in handles:
            h.remove()
    for i, call in enumerate(record):
        per[i]["core"] = call
    return {"layers": per, "head_in": head[0]}


def dense_mask(idx: Tensor, n_keys: int) -> Tensor:
    """The additive mask ``[b, 1, m, n]`` (0 on the picked keys, -inf elsewhere) of picks ``idx [b, m, k]``."""
    b, m, _ = idx.shape
    mask = torch.full((b, m, n_keys + 1), float("-inf"))
    mask.scatter_(-1, torch.where(idx >= 0, idx.long(), n_keys), 0.0)
    return mask[..., :n_keys].unsqueeze(1)


def pick_agreement(ours: Tensor, theirs: Tensor) -> float:
    """Share of ``theirs``' valid picks (``>= 0``) that ``ours`` also made, per query row ``[..., k]``."""
    valid = theirs >= 0
    hit = (theirs.unsqueeze(-1) == ours.unsqueeze(-2)).any(-1) & valid
    return float(hit.sum() / valid.sum().clamp_min(1))


def _layer_inputs(hf: nn.Module, x: Tensor) -> dict[str, Any]:
    from transformers.masking_utils import create_sliding_window_causal_mask

    inner = hf.model
    T = x.shape[1]
    pos = torch.arange(T).unsqueeze(0)
    pe = {k: inner.rotary_emb(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=pos)
    return {"position_embeddings": pe, "position_ids": pos, "attention_mask": mask}


@torch.no_grad()
def op_errors(hf: nn.Module, cap: dict[str, Any], tokens: Tensor, reference_head: Any) -> dict[str, Any]:
    """``{op: [per-layer value]}``: relative differences of each op's output given the reference's input
    (``None`` where a layer has no such op), and the indexer's pick agreement. ``reference_head(streams)``:
    the reference's logits at every position from the head's input streams."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_mod

    inner = hf.model
    rows: dict[str, list] = {k: [] for k in ("attention sublayer", "attention core", "compressor entries",
                                             "indexer picks (agreement)", "router weights", "router experts (agreement)",
                                             "MoE (routed + shared)", "shared expert", "hc mixing + norms")}
    for i, layer in enumerate(inner.layers):
        c = cap["layers"][i]
        (x_attn, _start), attn_out = c["attn"]
        kw = _layer_inputs(hf, x_attn)
        rows["attention sublayer"].append(rel(layer.self_attn(x_attn, cache=None, **kw)[0], attn_out))
        q, kv, sink, idx, scale, out = c["core"]
        attn = layer.self_attn
        args = (attn, q.transpose(1, 2), kv.unsqueeze(1), kv.unsqueeze(1), dense_mask(idx, kv.shape[1]).to(q.dtype))
        core = reference_ops.attention_for(attn, hf_mod.eager_attention_forward)
        rows["attention core"].append(rel(core(*args, scaling=scale)[0], out))
        T = x_attn.shape[1]
        pos = torch.arange(T).unsqueeze(0)
        comp = attn.compressor
        if comp is None:
            rows["compressor entries"].append(None)
        else:
            (x_c, _), entries = c["compressor"]
            q_res = torch.zeros(x_c.shape[0], T, int(hf.config.q_lora_rank), dtype=x_c.dtype)
            rows["compressor entries"].append(rel(comp(x_c, q_res, pos, None, i)[0][:, 0], entries))
        if comp is None or not hasattr(comp, "indexer"):
            rows["indexer picks (agreement)"].append(None)
        else:
            (x_i, qr, _s, offset), picks = c["indexer"]
            ours = comp.indexer(x_i, qr, pos, None, i)
            theirs = torch.where(picks >= 0, picks - offset, picks)
            rows["indexer picks (agreement)"].append(pick_agreement(ours, theirs))
        (x_f, ids), ffn_out = c["ffn"]
        x_f3 = x_f.view(*tokens.shape, -1)
        (_, weights, experts) = (layer.mlp.gate(x_f3, tokens) if layer.mlp.is_hash else layer.mlp.gate(x_f3))
        (_, _), (w_ref, e_ref) = c["gate"]
        order, order_ref = experts.sort(-1), e_ref.long().sort(-1)
        same = (order.values == order_ref.values).all(-1)
        rows["router experts (agreement)"].append(float(same.float().mean()))
        w = weights.gather(1, order.indices)[same]
        rows["router weights"].append(rel(w, w_ref.gather(1, order_ref.indices)[same]))
        rows["MoE (routed + shared)"].append(rel(layer.mlp(x_f3, input_ids=tokens), ffn_out.view_as(x_f3)))
        (x_s,), shared = c["shared"]
        rows["shared expert"].append(rel(layer.mlp.shared_experts(x_s), shared))
        rows["hc mixing + norms"].append(rel(_teacher_forced_layer(hf, i, c, tokens), c["block"][1]))
    x = inner.hc_head(cap["head_in"])
    rows["head"] = [rel(hf.lm_head(inner.norm(x)), reference_head(cap["head_in"]))]
    return rows


def _teacher_forced_layer(hf: nn.Module, i: int, c: dict[str, Any], tokens: Tensor) -> Tensor:
    """Decoder layer ``i`` on the reference's input streams, its attention and MoE outputs replaced by the
    reference's."""
    layer = hf.model.layers[i]
    streams = c["in"]
    attn_out, ffn_out = c["attn"][1], c["ffn"][1].view(*streams.shape[:2], -1)
    handles = [
        layer.self_attn.register_forward_hook(lambda _m, _a, out: (attn_out, *out[1:])),
        layer.mlp.register_forward_hook(lambda _m, _a, _out: ffn_out),
    ]
    try:
        return layer(streams, input_ids=tokens, cache=None, **_layer_inputs(hf, streams[:, :, 0]))
    finally:
        for h in handles:
            h.remove()


def core_floor(cap: dict[str, Any]) -> dict[str, list[float]]:
    """The attention core's floor per layer: the reference's call (blocks of 64, bf16 probabilities) against
    two other legitimate emulations of the kernel (blocks of 8; probabilities kept in fp32)."""
    out: dict[str, list[float]] = {"attention core, floor (blocks of 8)": [], "attention core, floor (fp32 probabilities)": []}
    for c in cap["layers"]:
        q, kv, sink, idx, scale, ref_out = c["core"]
        out["attention core, floor (blocks of 8)"].append(rel(emu.sparse_attn_emulated(q, kv, sink, idx, scale, block=8), ref_out))
        out["attention core, floor (fp32 probabilities)"].append(
            rel(emu.sparse_attn_emulated(q, kv, sink, idx, scale, round_probs=False), ref_out))
    return out
