"""TransformerLens's model surface on every kind (issue 46, item 1): per-block attention and MLP weights in
TransformerLens's shapes, the model-level names, ``cfg``, ``accumulated_bias`` and the module habits, against a
``TransformerBridge`` holding the same fp64 weights (causal-LM adapters) or against the model's own hooks (zoo)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import phaselens
from phaselens.errors import PhaseLensError
from phaselens.models.parts.tl_weights import SurfaceError
from tests.support.tl_reference import pair

ATTN = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
MLP = ("W_in", "W_gate", "W_out", "b_in", "b_out")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def adapted(request):
    return (request.param, *pair(request.param))


def _same(mine, theirs, n_heads, name):
    assert (mine is None) == (theirs is None), name
    if mine is None:
        return
    if name.rsplit(".", 1)[-1] in ("W_K", "W_V", "b_K", "b_V") and theirs.shape[0] != n_heads:  # TL 4.3 keeps n_kv heads; we widen
        theirs = theirs.repeat_interleave(n_heads // theirs.shape[0], dim=0)
    assert mine.shape == theirs.shape, name
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12, msg=name)


def test_adapter_weights_are_the_bridges(adapted):
    arch, model, ref, _ = adapted
    H = model.cfg.n_heads
    assert len(model.blocks) == model.cfg.n_layers == ref.cfg.n_layers
    for layer in range(model.cfg.n_layers):
        mine, theirs = model.blocks[layer], ref.blocks[layer]
        for name in ATTN:
            _same(getattr(mine.attn, name), getattr(theirs.attn, name), H, f"{layer}.attn.{name}")
        for name in MLP:
            _same(getattr(mine.mlp, name), getattr(theirs.mlp, name, None), H, f"{layer}.mlp.{name}")
    for name in ("W_E", "W_U", "b_U", "W_Q", "W_O", "W_in", "W_out"):
        _same(getattr(model, name), getattr(ref, name), H, name)
    if arch == "gpt2":
        _same(model.W_pos, ref.W_pos, H, "W_pos")
        _same(model.b_O, ref.b_O, H, "b_O")
    else:
        assert not hasattr(model, "W_pos")
        with pytest.raises(SurfaceError, match="rotary"):
            model.W_pos  # noqa: B018
    assert model.cfg.d_mlp == ref.cfg.d_mlp
    assert model.cfg.n_key_value_heads == (ref.cfg.n_key_value_heads or ref.cfg.n_heads)


def test_accumulated_bias_is_the_bridges(adapted):
    _, model, ref, _ = adapted
    for layer in range(model.cfg.n_layers + 1):
        for mlp_input in (False, True)[: 1 + (layer < model.cfg.n_layers)]:
            for incl in (False, True):
                torch.testing.assert_close(model.accumulated_bias(layer, mlp_input, incl),
                                           ref.accumulated_bias(layer, mlp_input, incl).to(torch.float64),
                                           rtol=0, atol=1e-12)
    with pytest.raises(PhaseLensError, match="layer must lie"):
        model.accumulated_bias(model.cfg.n_layers, mlp_input=True)


def test_neuron_hooks_are_the_bridges(adapted):
    _, model, ref, tokens = adapted
    _, mine = model.run_with_cache(tokens)
    _, theirs = ref.run_with_cache(tokens)
    names = [n for n in model.hook_dict if ".mlp.hook_" in n]
    assert {"blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_post"} <= set(names)
    for name in names:
        assert mine[name].shape[-1] == model.cfg.d_mlp
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-10, msg=name)
    # hook_post @ W_out + b_out is the MLP's output: the names fit together as TransformerLens's do
    mlp = model.blocks[1].mlp
    out = mine["blocks.1.mlp.hook_post"] @ mlp.W_out + (0 if mlp.b_out is None else mlp.b_out)
    torch.testing.assert_close(out, mine["blocks.1.hook_mlp_out"], rtol=0, atol=1e-10)


def test_a_neuron_hook_edits_the_forward(adapted):
    _, model, ref, tokens = adapted

    def kill(x, hook):
        x = x.clone()
        x[..., :5] = 0
        return x

    mine = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_post", kill)])
    theirs = ref.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_post", kill)])
    assert (mine - model(tokens)).abs().max() > 1e-3
    torch.testing.assert_close(mine, theirs.to(mine.dtype), rtol=0, atol=1e-6)


def test_views_share_memory_and_edits_reach_the_model(adapted):
    _, model, _, tokens = adapted
    attn = model.blocks[0].attn
    o_proj = model._layout.out_proj[0].weight
    w_o = attn.W_O
    assert w_o.untyped_storage().data_ptr() == o_proj.untyped_storage().data_ptr()  # a view, no copy
    mlp = model._layout.mlp[0]._modules
    down = (mlp.get("down_proj") or mlp["c_proj"]).weight
    assert model.blocks[0].mlp.W_out.untyped_storage().data_ptr() == down.untyped_storage().data_ptr()
    before = model(tokens)
    saved = w_o[1].clone()
    with torch.no_grad():
        attn.W_O[1] = 0  # through the view
    try:
        assert (model(tokens) - before).abs().max() > 1e-4
        assert torch.equal(w_o[1], torch.zeros_like(w_o[1]))  # the view taken before the edit sees it
    finally:
        with torch.no_grad():
            attn.W_O[1] = saved
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    if model.cfg.n_key_value_heads < model.cfg.n_heads:  # GQA: widened on access (a copy), the KV heads a view
        assert attn.W_K.untyped_storage().data_ptr() != o_proj.untyped_storage().data_ptr()
        k = model._layout.qkv[0][1].weight
        assert attn.W_K_kv.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        torch.testing.assert_close(attn.W_K, attn.W_K_kv.repeat_interleave(2, dim=0), rtol=0, atol=0)


def test_eval_train_to_on_the_adapter(adapted):
    _, model, _, tokens = adapted
    model.model.train()
    assert model.eval() is model and not model.model.training
    assert model.train(False) is model
    with pytest.raises(SurfaceError, match="evaluation mode"):
        model.train()
    assert not model.model.training
    before = model(tokens)
    try:
        assert model.to(torch.float32) is model and model.cfg.dtype == torch.float32
        torch.testing.assert_close(model(tokens), before.float(), rtol=1e-4, atol=1e-4)
    finally:
        model.to(torch.float64)
    assert model.cfg.dtype == torch.float64
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in model.model.parameters())
    assert list(model.state_dict()) == list(model.model.state_dict())


def test_moe_mlp_refuses_neuron_names_as_transformer_lens_does():
    from tests.support.tl_reference import tiny_mixtral

    model = tiny_mixtral()
    assert model.cfg.d_mlp is None
    assert not any(".mlp.hook_" in n for n in model.hook_dict)
    with pytest.raises(SurfaceError, match="mixture of experts.*hook_mlp_out"):
        model.blocks[0].mlp.W_out  # noqa: B018
    assert model.blocks[0].attn.W_O.shape == (4, 16, 64)
    assert torch.equal(model.accumulated_bias(2), torch.zeros(64))


# ---- the zoo ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo():
    model = phaselens.load("zoo:w8s4")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    return model, tokens


def test_zoo_blocks_have_transformer_lens_shapes_as_views(zoo):
    model, _ = zoo
    c = model.cfg
    H, d, D = c.n_heads, c.d_head, c.d_model
    for block in model.blocks:
        a = block.attn
        assert a.W_Q.shape == a.W_K.shape == a.W_V.shape == (H, D, d)
        assert a.W_O.shape == (H, d, D)
        for name, flat in (("W_Q", "W_Q"), ("W_O", "W_O"), ("W_K", "W_KV" if a.tied else "W_K")):
            assert getattr(a, name).data_ptr() == a.flat(flat).data_ptr()  # same storage, same start: a view
        assert a.b_O is None
    torch.testing.assert_close(model.W_O[1], model.blocks[1].attn.W_O, rtol=0, atol=0)


def test_zoo_views_compute_the_models_hooks(zoo):
    model, tokens = zoo
    _, cache = model.run_with_cache(tokens)
    for layer, block in enumerate(model.blocks):
        a, m = block.attn, block.mlp
        out = torch.einsum("bnhd,hdm->bnm", cache[f"blocks.{layer}.attn.hook_z"], a.W_O)
        torch.testing.assert_close(out, cache[f"blocks.{layer}.hook_attn_out"], rtol=1e-5, atol=1e-5)
        if not model.config.qk_norm:  # a QK-norm would follow W_Q
            x = block.ln1(cache[f"blocks.{layer}.hook_resid_pre"])
            torch.testing.assert_close(torch.einsum("bnm,hmd->bnhd", x, a.W_Q), cache[f"blocks.{layer}.attn.hook_q"],
                                       rtol=1e-5, atol=1e-5)
        mlp = cache[f"blocks.{layer}.mlp.hook_post"] @ m.W_out + (0 if m.b_out is None else m.b_out)
        torch.testing.assert_close(mlp, cache[f"blocks.{layer}.hook_mlp_out"], rtol=1e-5, atol=1e-5)
    assert model.cfg.d_mlp == model.blocks[0].mlp.W_out.shape[0]
    b_out = sum(b.mlp.b_out for b in model.blocks) if model.blocks[0].mlp.b_out is not None else 0
    torch.testing.assert_close(model.accumulated_bias(model.cfg.n_layers), torch.zeros(model.cfg.d_model) + b_out)
    assert torch.equal(model.b_U, torch.zeros(model.cfg.d_vocab))
    with pytest.raises(SurfaceError, match="rotary"):
        model.W_pos  # noqa: B018


def test_zoo_checkpoint_loads_unchanged(zoo):
    from pathlib import Path

    model, _ = zoo
    path = Path(phaselens.__file__).parent / "zoo" / "w8s4" / "model.safetensors"
    state = model.state_dict()
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        assert keys <= set(state)
        for key in keys:
            stored = f.get_tensor(key)
            assert state[key].shape == stored.shape, key
            assert torch.equal(state[key].to(stored.dtype), stored), key


# ---- DeepSeek-V4 and V4.1: factored weights, refused with the factors ----------------------------------------
def _refusals(model):
    block = model.blocks[0]
    for name, factors in (("W_Q", "q_a.*RMSNorm.*q_b"), ("W_K", "kv_norm"), ("W_V", "kv_norm"),
                          ("W_O", "o_b\\(o_a"), ("b_O", "no biases")):
        with pytest.raises(SurfaceError, match=factors):
            getattr(block.attn, name)
        assert not hasattr(block.attn, name)
    for name in ("W_in", "W_out", "b_out"):
        with pytest.raises(SurfaceError, match="mixture of experts.*hook_mlp_out"):
            getattr(block.mlp, name)
    with pytest.raises(SurfaceError, match="hyper-connection"):
        model.accumulated_bias(1)
    with pytest.raises(SurfaceError, match="no learned position"):
        model.W_pos  # noqa: B018


def test_deepseek_v4_adapter_refuses_factored_weights_by_name():
    from tests.support.deepseek import tiny_v4_model

    model = phaselens.from_hf(tiny_v4_model())
    assert len(model.blocks) == model.cfg.n_layers
    _refusals(model)


def test_deepseek_v41_refuses_factored_weights_by_name(tmp_path):
    import warnings

    from tests.support.deepseek_v41 import write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp_path / "tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = phaselens.load(f"hf:{root}", dtype=torch.float32, index_topk="all")
    _refusals(model)
    assert isinstance(model.blocks[0].attn, torch.nn.Module)  # the real module, names added


def test_a_transformer_lens_3_hooked_transformer_is_told_how_to_come():
    from types import SimpleNamespace

    class HookedTransformer(torch.nn.Module):  # what TL 3.x built: cfg, blocks, W_E, no transformers config
        def __init__(self):
            super().__init__()
            self.cfg = SimpleNamespace(n_layers=1, d_model=8)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
            self.W_E = torch.nn.Parameter(torch.zeros(10, 8))

    with pytest.raises(PhaseLensError, match="TransformerLens 3.x HookedTransformer.*save_pretrained.*"
                                             "TransformerBridge.boot_transformers"):
        phaselens.load(HookedTransformer(), stride=4)
    with pytest.raises(PhaseLensError, match="not a transformers model"):  # any other module: the plain refusal
        phaselens.load(torch.nn.Linear(3, 3), stride=4)
