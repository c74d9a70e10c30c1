"""Any transformers causal LM at a stride: logits, hook sites, patterns, knockouts and the query-suffix engine, each
against plain transformers computations (no phaselens code in the references)."""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.contract.cells import Cell
from phaselens.errors import HookNameError, InputError, UnsupportedModelError
from tests.support.causal_lm import ARCHS, VOCAB, Snapshot, tiny_causal_lm

TOL = 1e-5


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    torch.set_num_threads(1)
    return request.param, tiny_causal_lm(request.param, seed=1)


def _ids(seed: int = 0, B: int = 3, T: int = 21) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _plain(hf, ids, o_proj_pre=None):
    """transformers' own logits (eval mode restored after), optionally with a raw torch pre-hook on every
    attention output projection: ``o_proj_pre(layer, x [B, T, H * d]) -> x``."""
    from phaselens.models.causal_lm import model_layout

    lay, handles = model_layout(hf), []
    was = hf.training
    hf.eval()
    try:
        for i, proj in enumerate(lay.out_proj):
            if o_proj_pre is not None:
                handles.append(proj.register_forward_pre_hook(lambda m, a, i=i: (o_proj_pre(i, a[0]),)))
        with torch.no_grad():
            return hf(_ids() if ids is None else ids).logits
    finally:
        for h in handles:
            h.remove()
        hf.train(was)


def test_logits_equal_transformers(arch):
    name, hf = arch
    model = phaselens.load(hf, stride=4)
    ids = _ids()
    with torch.no_grad():
        got = model(ids)
        query = model(ids, logits="query", query_len=3)
    ref = _plain(hf, ids)
    assert torch.allclose(got, ref, atol=TOL), name
    assert torch.allclose(query, ref[:, -3:], atol=TOL)
    assert model.dims.phase_specs == (None, None) and model.dims.analysis_spec.stride == 4
    assert model.analysis_metadata["attention"] == "full" and model.analysis_metadata["model_type"] == name


def test_hook_z_is_the_output_projection_input(arch):
    """Zeroing head 1 of layer 1 at hook_z equals zeroing that slice of o_proj's / c_proj's input by hand."""
    name, hf = arch
    model = phaselens.load(hf, stride=4)
    d = model.dims.d_head
    ids = _ids(1)

    def zero(z, hook):
        z = z.clone()
        z[:, :, 1] = 0
        return z

    with torch.no_grad():
        got = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", zero)])

    def by_hand(layer, x):
        if layer != 1:
            return x
        x = x.clone()
        x[..., d : 2 * d] = 0
        return x

    ref = _plain(hf, ids, by_hand)
    assert torch.allclose(got, ref, atol=TOL), name
    assert (got - _plain(hf, ids)).abs().max() > 1e-4  # the knockout moved the logits


def test_pattern_is_the_softmax_and_editable(arch):
    """hook_pattern [B, H, q, k] rows sum to 1, are causal, rebuild hook_z from hook_v, and an edit changes z to
    P' @ V (values shared by GQA groups)."""
    name, hf = arch
    model = phaselens.load(hf, stride=4)
    ids = _ids(2)
    names = ["blocks.1.attn.hook_pattern", "blocks.1.attn.hook_z", "blocks.1.attn.hook_v"]
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=names)
    p, z, v = (cache[n] for n in names)
    B, H, T, K = p.shape
    assert (B, H, T, K) == (3, 4, 21, 21)
    assert torch.allclose(p.sum(-1), torch.ones(B, H, T), atol=1e-5)
    assert float(p.triu(1).abs().max()) == 0.0 or name == "mistral"  # causal (Mistral: also a window)
    g = H // v.shape[2]
    assert torch.allclose(torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(g, 2)), z, atol=1e-5)
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    kept = {}
    with torch.no_grad():
        model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: uniform.expand_as(p).clone()),
                                             ("blocks.1.attn.hook_z", lambda z, hook: kept.setdefault("z", z.clone()))])
    assert torch.allclose(kept["z"], torch.einsum("qk,bkhd->bqhd", uniform, v.repeat_interleave(g, 2)), atol=1e-5)


def test_suffix_engine_equals_full_forwards_on_every_head(arch):
    """Every (layer, head) zero and mean-like knockout, two query slots: the engine's cells equal full hooked
    forwards at 1e-5 (fp32)."""
    name, hf = arch
    model = phaselens.load(hf, stride=4)
    ids = _ids(3, B=4, T=24)
    qp = torch.tensor([17, 23, 17, 20])
    L, H, d = model.dims.n_layers, model.dims.n_heads, model.dims.d_head
    shared = torch.randn(1, d, generator=torch.Generator().manual_seed(0))
    cells = [Cell(layer, [h], None if h % 2 else shared) for layer in range(L) for h in range(H)]
    cells.append(Cell(1, list(range(H)), None))  # a whole layer
    with torch.no_grad():
        eng = model.query_engine(ids, qp, rows_per_pass=8)  # several passes per layer
        got = eng.run(cells)
        clean = model(ids)[torch.arange(4), qp]
    assert torch.allclose(eng.clean_logits, clean, atol=TOL)
    for i, c in enumerate(cells):
        def ko(z, hook, c=c):
            z = z.clone()
            value = torch.zeros(d) if c.replacement is None else c.replacement[0]
            z[torch.arange(4)[:, None], qp[:, None], torch.tensor(c.heads)[None]] = value
            return z

        with torch.no_grad():
            ref = model.run_with_hooks(ids, fwd_hooks=[(f"blocks.{c.layer}.attn.hook_z", ko)])[torch.arange(4), qp]
        assert torch.allclose(got[i], ref, atol=TOL), (name, c.layer, c.heads)


def test_every_hook_site_fires_with_its_shape(arch):
    name, hf = arch
    model = phaselens.load(hf, stride=4)
    ids = _ids(4, B=2, T=9)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    assert set(cache.keys()) == set(model.hook_dict)
    H, Hkv, d = model.dims.n_heads, model.dims.n_key_value_heads, model.dims.d_head
    Hkv = H if name == "gpt2" else Hkv
    assert cache["blocks.0.attn.hook_q"].shape == (2, 9, H, d)
    assert cache["blocks.0.attn.hook_k"].shape == (2, 9, Hkv, d)
    assert cache["blocks.1.attn.hook_z"].shape == (2, 9, H, d)
    assert cache["blocks.1.hook_resid_post"].shape == (2, 9, 64)
    assert torch.allclose(cache["blocks.1.hook_resid_pre"], cache["blocks.0.hook_resid_post"])
    mid = cache["blocks.0.hook_resid_pre"] + cache["blocks.0.hook_attn_out"]
    assert torch.allclose(cache["blocks.0.hook_resid_mid"], mid, atol=1e-6)
    assert torch.allclose(cache["blocks.0.hook_resid_post"], mid + cache["blocks.0.hook_mlp_out"], atol=1e-6)


def test_object_left_as_it_was_also_when_a_hook_raises():
    hf = tiny_causal_lm("qwen3", seed=2)
    before = Snapshot.of(hf)
    model = phaselens.load(hf, stride=4)

    def boom(p, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(_ids(), fwd_hooks=[("blocks.1.attn.hook_pattern", boom)])
    before.assert_same(hf)
    with pytest.raises(RuntimeError, match="boom"), model.hooks(fwd_hooks=[("blocks.0.attn.hook_z", boom)]):
        model(_ids())
    before.assert_same(hf)
    model.run_with_cache(_ids(), names_filter=lambda n: "pattern" in n)
    before.assert_same(hf)
    assert hf.training  # still as transformers built it


def test_names_and_refusals():
    hf = tiny_causal_lm("llama")
    model = phaselens.load(hf, stride=4, window=8, origin=1)
    assert model.analysis_spec == phaselens.PhaseSpec(4, 8, 1)
    with pytest.raises(HookNameError, match="no compressed entries"):
        model.run_with_hooks(_ids(), fwd_hooks=[("blocks.0.attn.hook_pattern_entry", lambda x, hook: None)])
    with pytest.raises(HookNameError, match="hook_resid_post"):
        model.hook_dict["blocks.0.hook_resid_pots"]
    with pytest.raises(InputError, match="stride="):
        phaselens.load(hf)
    with pytest.raises(InputError, match="read-only"):
        model.run_with_hooks(_ids(), fwd_hooks=[("blocks.0.hook_resid_mid", lambda x, hook: x + 1)])
    with pytest.raises(InputError, match="token ids"):
        model(torch.tensor([[VOCAB]]))
    with pytest.raises(UnsupportedModelError, match="transformers model"):
        phaselens.load(torch.nn.Linear(2, 2), stride=4)


def test_the_family_qwen3_export_computes_as_the_family_control():
    """phaselens.models.compressed.qwen3.to_qwen3 of the paper family's full-attention control: the adapter on the
    export gives the CompressedTransformer's logits and per-head z."""
    from phaselens.models.compressed.qwen3 import to_qwen3
    from phaselens.train.family.recipes import family_config

    ours = phaselens.models.CompressedTransformer(family_config("full", "tiny", seed=5)).eval()
    model = phaselens.load(to_qwen3(ours), stride=4)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, ca = ours.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_z"))
        b, cb = model.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_z"))
    assert torch.allclose(a, b, atol=TOL)
    for name in ca.keys():
        assert torch.allclose(ca[name], cb[name], atol=TOL), name
