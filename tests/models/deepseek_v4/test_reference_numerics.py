"""``numerics="reference"`` follows DeepSeek's published V4 inference (issue 25): the semantics it changes in any
dtype (the shared expert's clamp, the compressed RoPE's magnitude), the bf16 arithmetic of its kernels (against
the CPU emulations in ``tests/support/deepseek_reference.py`` and formulas written from the reference's description),
the quantization settings, and what the adapter reports about a binding ``index_topk``.

The comparison with DeepSeek's own code is ``tests/reference/v4_parity.py`` (and
``tests/models/deepseek_v4/test_reference_parity.py`` when a local copy is given)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from phaselens.errors import ConfigError
from phaselens.models.deepseek_v4 import IndexTopKWarning, from_transformers
from phaselens.models.deepseek_v4.numerics import restore, swapped, unscaled_yarn
from phaselens.models.deepseek_v4.quantization import fp8_simulate
from phaselens.models.deepseek_v4.reference_ops import reference_attention
from phaselens.models.parts.numerics_deepseek import mix_streams
from phaselens.storage.fingerprints import model_fingerprint
from tests.support.deepseek import (
    FLASH_CONFIG,
    QUANTIZABLE,
    one_thread,  # noqa: F401  (fixture)
    random_tokens,
    released_config,
    tiny_v4_bf16,
    tiny_v4_model,
)
from tests.support.deepseek_reference import act_quant_emulated, reference_rows, sparse_attn_emulated

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """Residual-dominated (embedding x50, as in a trained model), quantizable sizes, 8 indexer heads."""
    return tiny_v4_bf16(tmp_path_factory.mktemp("v4"), embed_scale=50.0, index_n_heads=8, **QUANTIZABLE)


# ---- the shared expert -----------------------------------------------------------------------------------
def _shared_with_known_activations(model):
    """Layer 0's shared expert made to compute ``silu(g) * u`` on its first 3 units (``x`` = unit vector 0):
    ``(g, u)`` = (12, 15), (-3, -14), (2, 4); the down projection copies unit ``i`` to output ``i``."""
    mlp = model.model.layers[0].mlp.shared_experts
    with torch.no_grad():
        for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
            p.zero_()
        mlp.gate_proj.weight[:3, 0] = torch.tensor([12.0, -3.0, 2.0])
        mlp.up_proj.weight[:3, 0] = torch.tensor([15.0, -14.0, 4.0])
        mlp.down_proj.weight[:3, :3] = torch.eye(3)
    x = torch.zeros(1, 1, model.config.hidden_size)
    x[..., 0] = 1.0
    return mlp, x


def silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def test_the_shared_expert_is_not_clamped_under_reference_numerics():
    """The reference builds its shared expert without swiglu_limit (10); transformers clamps up to +-10 and the
    gate from above at 10. By hand: silu(12) * 15 = 179.9989, silu(-3) * -14 = 1.9927, silu(2) * 4 = 7.0464;
    clamped: silu(10) * 10 = 99.9955 and silu(-3) * -10 = 1.4228."""
    model = tiny_v4_model()
    mlp, x = _shared_with_known_activations(model)
    from_transformers(model)  # numerics="reference", also in fp32
    assert type(mlp).__name__ == "ReferenceSharedExpertDeepseekV4MLP"
    with torch.no_grad():
        ours = mlp(x)[0, 0, :3]
    expected = torch.tensor([silu(12) * 15, silu(-3) * -14, silu(2) * 4])
    assert torch.allclose(ours, expected, rtol=1e-6) and ours[0].item() == pytest.approx(179.9989, abs=1e-4)
    from_transformers(model, numerics="transformers")  # what plain mode does: transformers clamps the shared expert
    with torch.no_grad():
        plain = mlp(x)[0, 0, :3]
    clamped = torch.tensor([silu(10) * 10, silu(-3) * -10, silu(2) * 4])
    assert torch.allclose(plain, clamped, rtol=1e-6) and plain[0].item() == pytest.approx(99.9955, abs=1e-4)


def test_the_shared_expert_changes_the_logits_only_when_it_passes_the_limit():
    model = tiny_v4_model()
    tokens = random_tokens(1, 12, 0)
    with torch.no_grad():
        small = [from_transformers(model, numerics=n)(tokens) for n in ("transformers", "reference")]
        model.model.layers[0].mlp.shared_experts.up_proj.weight.mul_(2000.0)  # activations far past 10
        large = [from_transformers(model, numerics=n)(tokens) for n in ("transformers", "reference")]
    assert torch.equal(small[0], small[1])  # a random model never reaches the limit: nothing changes
    assert (large[0] - large[1]).abs().max() > 0.1 * large[1].abs().max()


# ---- the compressed path's RoPE ------------------------------------------------------------------------
UNSCALED = {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0, "original_max_position_embeddings": 65536,
            "partial_rotary_factor": 0.25}  # no attention_factor: transformers would scale cos/sin by 1.277


def _unscaled_model():
    return tiny_v4_model(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": dict(UNSCALED),
    })


def test_a_nested_yarn_without_attention_factor_gets_no_magnitude_scale():
    model = _unscaled_model()
    comp = model.model.layers[1].self_attn.compressor
    assert unscaled_yarn(model.config) == ["compress"]
    assert comp.rotary_emb.compress_attention_scaling == pytest.approx(0.1 * math.log(16) + 1)  # 1.2773
    adapter = from_transformers(model)
    assert comp.rotary_emb.compress_attention_scaling == model.model.rotary_emb.compress_attention_scaling == 1.0
    assert any("compress RoPE" in c and "1.2773" in c for c in adapter.analysis_metadata["numerics_changes"])
    h = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rows = comp(h, torch.zeros(2, 64, 32), torch.arange(64)[None].expand(2, -1), None, 1)[0][:, 0]
    truth = reference_rows(comp, h.double(), proj=F64, out=F64, table=F64, rope_dims=16)  # no scaling anywhere
    assert (rows.double() - truth).abs().max() < 1e-5
    faithful = tiny_v4_model()  # the same weights with attention_factor 1.0 in the config
    tokens = random_tokens(1, 40, 2)
    with torch.no_grad():
        assert torch.equal(adapter(tokens), from_transformers(faithful)(tokens))
    restore(model)  # the scale comes back with transformers' own computation
    assert comp.rotary_emb.compress_attention_scaling == pytest.approx(1.2773, abs=1e-4)


def test_transformers_numerics_refuse_it_naming_the_field():
    model = _unscaled_model()
    with pytest.raises(ConfigError, match=r'rope_parameters\["compress"\]\["attention_factor"\] is missing'):
        from_transformers(model, numerics="transformers")
    assert swapped(model) == {}  # refused before anything changed


def test_the_released_flat_config_needs_nothing():
    """A released config.json's flat rope_scaling: transformers gives the compressed YaRN attention_factor 1.0."""
    small = dict(FLASH_CONFIG, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=128,
                 qk_rope_head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=2, index_head_dim=64,
                 vocab_size=512, compress_ratios=[0, 4, 128, 0])
    small.pop("quantization_config")
    from transformers import DeepseekV4ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DeepseekV4ForCausalLM(released_config(small)).eval()
    assert model.config.rope_parameters["compress"]["attention_factor"] == 1.0 and unscaled_yarn(model.config) == []
    for numerics in ("transformers", "reference"):
        adapter = from_transformers(model, numerics=numerics)
        assert not any("RoPE (YaRN" in c for c in adapter.analysis_metadata["numerics_changes"])
        assert model.model.rotary_emb.compress_attention_scaling == 1.0


# ---- quantization: e4m3 as deployed, bf16 as the published kernel is written --------------------------
def test_fp8_rounds_through_e4m3_and_the_published_kernel_through_bf16():
    """One block of 64 with amax 448 (scale 1): e4m3 keeps 3 mantissa bits, so 1.0625 (a tie) -> 1.0 and
    3.3125 -> 3.25; the published act_quant(inplace=True) casts x / s to its output dtype, the input's bf16,
    which holds both exactly: it changes nothing."""
    x = torch.zeros(64, dtype=BF16)
    x[0], x[1], x[2], x[3] = 448.0, 1.0625, 3.3125, -0.3
    e4m3 = fp8_simulate(x)
    assert e4m3[:3].tolist() == [448.0, 1.0, 3.25] and e4m3[3].item() == -0.3125  # e4m3: 1.010b * 2**-2
    assert torch.equal(act_quant_emulated(x, 64, through=torch.float8_e4m3fn), e4m3)  # the kernel, cast to e4m3
    assert torch.equal(act_quant_emulated(x, 64, through=None), x)  # the kernel as published
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(8, 448, generator=g) * torch.logspace(-4, 3, 8)[:, None]).to(BF16)
    assert torch.equal(act_quant_emulated(y, 64, through=None), y)  # an identity on any bf16 input


@pytest.mark.parametrize("quantize", ["published", "fp8"])
def test_published_leaves_the_kv_and_both_round_the_indexer(bf16_model, quantize):
    tokens = random_tokens(2, 40, 4)
    names = ["blocks.0.attn.hook_kv", "blocks.1.attn.hook_entry"]
    _, plain = from_transformers(bf16_model, quantize=None).run_with_cache(tokens, names_filter=names)
    adapter = from_transformers(bf16_model, quantize=quantize)
    _, quant = adapter.run_with_cache(tokens, names_filter=names)
    kv, kv_q = plain["blocks.0.attn.hook_kv"], quant["blocks.0.attn.hook_kv"]  # layer 0: the same input
    if quantize == "published":
        assert torch.equal(kv_q, kv)
    else:
        assert torch.equal(kv_q[..., :64], fp8_simulate(kv[..., :64])) and not torch.equal(kv_q, kv)
    assert adapter.analysis_metadata["numerics_changes"][-1].startswith(f"quantize={quantize}: Hadamard")
    scorer = bf16_model.model.layers[1].self_attn.compressor.indexer.scorer
    assert type(scorer).__name__ == "ReferenceScorerDeepseekV4IndexerScorer" and scorer._phaselens_round
    from_transformers(bf16_model)


# ---- the attention core --------------------------------------------------------------------------------
class _Heads(torch.nn.Module):
    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks, self.num_key_value_groups = sinks, int(sinks.shape[0])


def _attention_case(k: int, seed: int = 0):
    """Queries ``[2, 24, 4, 64]`` and 160 keys (bf16), each row picking ``k`` of them (the last 10 none)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 24, 4, 64, generator=g).to(BF16)
    kv = torch.randn(2, 160, 64, generator=g).to(BF16)
    sinks = torch.randn(4, generator=g)
    idx = torch.stack([torch.randperm(160, generator=g)[:k] for _ in range(48)]).view(2, 24, k)
    idx[..., -10:] = -1
    mask = torch.full((2, 24, 161), float("-inf")).scatter_(-1, torch.where(idx >= 0, idx, 160), 0.0)
    return q, kv, sinks, idx, mask[..., :160].unsqueeze(1).to(BF16), 3 * 64**-0.5


def test_the_attention_core_is_the_kernels_within_its_own_floor():
    """Against the sparse_attn kernel's emulation (blocks of 64, bf16 probabilities): closer than the kernel is
    to itself under another legitimate emulation (blocks of 8, or probabilities kept fp32). transformers'
    bf16 eager attention is not (measured: ours 6.8e-4, floor 9.4e-4 and 1.3e-3, eager 8.7e-3)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    q, kv, sinks, idx, mask, scale = _attention_case(k=100)
    kernel = sparse_attn_emulated(q, kv, sinks, idx, scale)
    floor = min(rel(sparse_attn_emulated(q, kv, sinks, idx, scale, block=8), kernel),
                rel(sparse_attn_emulated(q, kv, sinks, idx, scale, round_probs=False), kernel))
    heads = _Heads(sinks)
    args = (heads, q.transpose(1, 2), kv[:, None], kv[:, None], mask, scale)
    ours, probs = reference_attention(*args)
    assert ours.shape == q.shape and ours.dtype == BF16
    assert rel(ours, kernel) < floor < 5 * floor < rel(eager_attention_forward(*args)[0], kernel)
    sink = torch.exp(sinks.view(1, 4, 1) - torch.logsumexp(torch.cat(
        [(q.transpose(1, 2).float() @ kv[:, None].float().transpose(-1, -2)) * scale + mask.float(),
         sinks.view(1, 4, 1, 1).expand(2, 4, 24, 1)], -1), -1))
    assert torch.allclose(probs.float().sum(-1) + sink, torch.ones(2, 4, 24), atol=1e-2)  # bf16 probabilities


def test_within_one_block_the_core_is_the_kernel_to_the_last_bit_but_rare_ties():
    """With at most 64 keys the kernel runs one block: the same arithmetic up to fp32 summation order."""
    q, kv, sinks, idx, mask, scale = _attention_case(k=60)
    kernel = sparse_attn_emulated(q, kv, sinks, idx, scale)
    ours = reference_attention(_Heads(sinks), q.transpose(1, 2), kv[:, None], kv[:, None], mask, scale)[0]
    diff = (ours.float() - kernel.float()).abs()
    # fp32 summation order differs (and differs by CPU), so a bf16 output near a rounding midpoint may land one
    # unit in the last place away: every difference is at most that, and they are rare (measured: 0.008% of the
    # outputs, mean-rel 3e-7; the bound is 300 times that, and a scale or mask error moves it by far more)
    assert (diff <= kernel.float().abs() * 2**-7).all()
    assert diff.sum() / kernel.float().abs().sum() < 1e-4


def test_the_swapped_attention_leaves_transformers_function_in_place(bf16_model):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    original = hf.eager_attention_forward
    adapter = from_transformers(bf16_model)
    with torch.no_grad():
        adapter(random_tokens(1, 20, 0))
    assert hf.eager_attention_forward is original

    def boom(t, *, hook):
        raise RuntimeError("user hook")

    with pytest.raises(RuntimeError, match="user hook"):
        adapter.run_with_hooks(random_tokens(1, 20, 0), fwd_hooks=[("blocks.1.attn.hook_z", boom)])
    assert hf.eager_attention_forward is original


def test_pattern_hooks_and_the_query_engine_run_the_same_core(bf16_model):
    """Reading the patterns must not change the computation; the engine's one-row passes use the reference's
    core too (their clean logits equal a forward of the same prefix pieces to the last bit)."""
    adapter = from_transformers(bf16_model, index_topk="all")
    tokens = random_tokens(2, 33, 5)
    with torch.no_grad():
        plain = adapter(tokens)
    seen = []
    hooked = adapter.run_with_hooks(tokens, fwd_hooks=[
        (lambda n: "hook_pattern" in n, lambda t, *, hook: seen.append(hook.name))])
    assert len(seen) == 4 + 3 + 4 and torch.equal(hooked, plain)
    engine = adapter.query_engine(tokens, torch.tensor([32, 32]))
    with torch.no_grad():
        chunked = adapter(tokens, chunk=32, query_len=1)[:, -1]
    assert torch.equal(engine.clean_logits, chunked)


# ---- the other ops, against the reference's description -------------------------------------------------
def test_the_moe_is_the_references_arithmetic(bf16_model):
    """Per token: fp32 router scores sqrt(softplus(x W^T)), experts by topk(scores + bias), weights normalised and
    scaled in fp32; each expert w2(bf16(weight * swiglu32(w1 x, w3 x))) (gate clamped from above, up both ways
    at the limit), summed in fp32 in expert order, plus the unclamped shared expert, rounded once."""
    from_transformers(bf16_model)
    mlp = bf16_model.model.layers[3].mlp  # layers 0-2 route by hash (transformers' default of 3 hash layers)
    x = torch.randn(1, 9, bf16_model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(BF16)
    with torch.no_grad():
        got = mlp(x)
        flat = x[0]
        scores = F.softplus(flat.float() @ mlp.gate.weight.float().T).sqrt()
        experts = (scores + mlp.gate.e_score_correction_bias).topk(mlp.gate.top_k, dim=-1).indices
        w = scores.gather(1, experts)
        w = w / w.sum(-1, keepdim=True) * mlp.gate.routed_scaling_factor
        limit, inter = float(bf16_model.config.swiglu_limit), mlp.experts.gate_up_proj.shape[1] // 2
        y = torch.zeros(9, flat.shape[1])
        for e in range(mlp.experts.num_experts):
            rows, slot = torch.where(experts == e)
            gu = mlp.experts.gate_up_proj[e]
            gate = (flat[rows] @ gu[:inter].T).float().clamp(max=limit)
            up = (flat[rows] @ gu[inter:].T).float().clamp(-limit, limit)
            h = (w[rows, slot, None] * (F.silu(gate) * up)).to(BF16)
            y.index_add_(0, rows, (h @ mlp.experts.down_proj[e].T).float())
        s = mlp.shared_experts
        shared = (F.silu((flat @ s.gate_proj.weight.T).float()) * (flat @ s.up_proj.weight.T).float()).to(BF16)
        expected = (y + (shared @ s.down_proj.weight.T).float()).to(BF16)
    assert torch.equal(got[0], expected)


def test_hyper_connections_mix_in_fp32_and_round_once():
    g = torch.Generator().manual_seed(4)
    out, streams = torch.randn(2, 5, 64, generator=g).to(BF16), torch.randn(2, 5, 4, 64, generator=g).to(BF16)
    post, comb = torch.rand(2, 5, 4, generator=g) * 2, torch.rand(2, 5, 4, 4, generator=g)
    truth = post.double()[..., None] * out.double()[..., None, :] + torch.einsum(
        "bsjk,bsjd->bskd", comb.double(), streams.double())
    ours = mix_streams(out, streams, post, comb)
    assert ours.dtype == BF16 and (ours.double() - truth).abs().max() <= (truth.abs() * 2**-8).max()
    assert (ours.double() - truth.to(BF16).double()).abs().gt(0).float().mean() < 1e-3  # rounded once
    bf16_mixing = post.to(BF16)[..., None] * out[..., None, :] + comb.to(BF16).transpose(-1, -2) @ streams
    assert rel(bf16_mixing, truth) > 1.5 * rel(ours, truth)  # transformers' bf16 mixing: measured 2.8e-3 vs 1.6e-3


def test_head_logits_and_router_are_fp32_and_the_switch_is_reversible(bf16_model):
    tokens = random_tokens(1, 16, 1)
    adapter = from_transformers(bf16_model)
    names = swapped(bf16_model)
    assert names["lm_head"] == "Fp32ProjectionLinear" and names["model.layers.2.mlp.gate"].startswith("ReferenceRouter")
    assert names["model.layers.0.self_attn.q_b_norm"] == "ReferenceQueryNormDeepseekV4UnweightedRMSNorm"
    with torch.no_grad():
        logits = adapter(tokens)
        hidden = bf16_model.model(tokens).last_hidden_state
    assert logits.dtype == F32 and torch.equal(logits, hidden.float() @ bf16_model.lm_head.weight.float().T)
    plain = from_transformers(bf16_model, numerics="transformers")
    assert swapped(bf16_model) == {}
    with torch.no_grad():
        assert plain(tokens).dtype == BF16


def test_gradients_flow_through_the_reference_core(bf16_model):
    adapter = from_transformers(bf16_model)
    kept = {}

    def keep(z, *, hook):
        z.retain_grad()
        kept["z"] = z

    with adapter.hooks(fwd_hooks=[("blocks.1.attn.hook_z", keep)]):
        adapter(random_tokens(1, 24, 6))[0, -1].sum().backward()
    assert kept["z"].grad is not None and kept["z"].grad.abs().sum() > 0


# ---- a binding index_topk: what the adapter reports -----------------------------------------------------
def test_fragile_picks_are_counted_from_the_scores(bf16_model):
    """Share of the binding rows' picks that score within half a bf16 epsilon (2**-8, relative) of the best entry
    left out, recomputed here by sorting the scorer's output."""
    k = 6
    adapter = from_transformers(bf16_model, index_topk=k)
    md0 = adapter.analysis_metadata
    assert md0["index_topk_fragile_picks"] is None and md0["index_topk_pick_agreement"]["measured"] == 0.998
    fingerprint = model_fingerprint(adapter)
    scores = {}
    handles = [bf16_model.model.layers[i].self_attn.compressor.indexer.scorer.register_forward_hook(
        lambda _m, _a, out, i=i: scores.__setitem__(i, out.float())) for i in (1, 3)]
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", IndexTopKWarning)
            adapter(random_tokens(2, 96, 8))
    finally:
        for h in handles:
            h.remove()
    for layer, s in scores.items():
        visible = (torch.arange(96) + 1) // 4
        s = s.masked_fill(torch.arange(24)[None, :] >= visible[:, None], float("-inf"))[:, visible > k]
        ranked = s.sort(-1, descending=True).values
        cut = ranked[..., k : k + 1]
        close = ranked[..., :k] <= cut + cut.abs() * 2**-8
        assert adapter.indexer_fragile[layer] == int(close.sum()) / close.numel()
    md = adapter.analysis_metadata
    assert md["index_topk_fragile_picks"] == pytest.approx(sum(adapter.indexer_fragile.values()) / 2)
    assert md["index_topk_binding"] and 0 < md["index_topk_fragile_picks"] < 0.2
    assert model_fingerprint(adapter) == fingerprint  # observed, not what the model is
    assert from_transformers(tiny_v4_model()).analysis_metadata["index_topk_pick_agreement"]["measured"] == 1.0  # fp32
    from_transformers(bf16_model, index_topk="all")
