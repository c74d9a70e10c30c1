"""TransformerLens's ``ActivationCache`` on phaselens models (issue 46, item 2): every method gives the answer of a
``TransformerBridge`` holding the same fp64 weights (causal-LM adapters), or the identities TransformerLens's
answer satisfies (zoo); kinds that cannot mean a method say why (a PhaseLensError, never a bare error from TL)."""

from __future__ import annotations

import pytest
import torch
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice

import phaselens
from phaselens.errors import PhaseLensError
from phaselens.models.parts.tl_habits import PhaseCache
from tests.support.tl_reference import bridge_over, pair

ATOL = 1e-10  # fp64 on both sides: rounding is ~1e-15


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def caches(request):
    model, ref, tokens = pair(request.param)
    _, mine = model.run_with_cache(tokens)
    _, theirs = ref.run_with_cache(tokens)
    return request.param, model, ref, tokens, mine, theirs


def _close(a, b, what):
    if isinstance(a, tuple):
        assert list(a[1]) == list(b[1]), what  # labels
        a, b = a[0], b[0]
    assert a.shape == b.shape, what
    torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=ATOL, msg=what)


CALLS = {
    "logit_lens": lambda c: (c.logit_lens().values, c.logit_lens().labels),
    "accumulated_resid": lambda c: c.accumulated_resid(incl_mid=True, return_labels=True),
    "accumulated_resid_ln_layer": lambda c: c.accumulated_resid(layer=1, apply_ln=True, return_labels=True),
    "accumulated_resid_ln_final": lambda c: c.accumulated_resid(apply_ln=True, pos_slice=Slice(-1)),
    "accumulated_resid_mlp_input": lambda c: c.accumulated_resid(layer=1, mlp_input=True, apply_ln=True),
    "decompose_resid": lambda c: c.decompose_resid(return_labels=True),
    "decompose_resid_ln_mid": lambda c: c.decompose_resid(layer=1, mlp_input=True, apply_ln=True, return_labels=True),
    "decompose_resid_attention": lambda c: c.decompose_resid(layer=2, mode="attn", incl_embeds=False),
    "stack_head_results": lambda c: c.stack_head_results(return_labels=True),
    "stack_head_results_ln_remainder": lambda c: c.stack_head_results(layer=1, apply_ln=True, incl_remainder=True,
                                                                      return_labels=True),
    "stack_neuron_results": lambda c: c.stack_neuron_results(layer=2, return_labels=True),
    "stack_neuron_results_slice_ln": lambda c: c.stack_neuron_results(layer=2, neuron_slice=Slice([3, 7]),
                                                                      apply_ln=True, return_labels=True),
    "stack_neuron_results_mlp_input_remainder": lambda c: c.stack_neuron_results(
        layer=1, mlp_input=True, incl_remainder=True, apply_ln=True, return_labels=True),
    "get_neuron_results": lambda c: c.get_neuron_results(1, neuron_slice=Slice([1, 5]), pos_slice=Slice(-1)),
    "get_neuron_results_projected": lambda c: c.get_neuron_results(0, project_output_onto=torch.linspace(
        -1, 1, 64, dtype=torch.float64)),
    "full_resid_decomposition": lambda c: c.get_full_resid_decomposition(return_labels=True),
    "full_resid_decomposition_no_neurons": lambda c: c.get_full_resid_decomposition(expand_neurons=False,
                                                                                    return_labels=True),
    "full_resid_decomposition_ln_mid": lambda c: c.get_full_resid_decomposition(layer=1, mlp_input=True,
                                                                                apply_ln=True, return_labels=True),
    "full_resid_decomposition_projected": lambda c: c.get_full_resid_decomposition(
        apply_ln=True, project_output_onto=torch.linspace(-1, 1, 64, dtype=torch.float64)),
    "apply_ln_to_stack": lambda c: c.apply_ln_to_stack(c.decompose_resid(layer=1), layer=1),
    "apply_ln_to_stack_final": lambda c: c.apply_ln_to_stack(c.decompose_resid(pos_slice=-1), layer=None,
                                                              pos_slice=Slice(-1)),
    "stack_activation": lambda c: c.stack_activation("pattern"),
    "stack_activation_scale": lambda c: c.stack_activation("scale", sublayer_type="ln2"),
    "sliced_accumulated_resid": lambda c: c.apply_slice_to_batch_dim(1).accumulated_resid(layer=1, apply_ln=True),
    "sliced_stack_head_results": lambda c: c.apply_slice_to_batch_dim(Slice([0])).stack_head_results(apply_ln=True),
    "remove_batch_dim": lambda c: c.apply_slice_to_batch_dim(Slice([1])).remove_batch_dim()["blocks.1.hook_resid_mid"],
    "getitem_tuple": lambda c: c["z", -1],
    "getitem_short": lambda c: c["resid_post", 0],
}


@pytest.mark.parametrize("call", list(CALLS))
def test_cache_method_is_the_bridges(caches, call):
    *_, mine, theirs = caches
    _close(CALLS[call](mine), CALLS[call](theirs), call)


def test_full_decomposition_sums_to_the_residual(caches):
    _, model, _, _, mine, _ = caches
    parts = mine.get_full_resid_decomposition(expand_neurons=True)
    torch.testing.assert_close(parts.sum(0), mine["blocks.1.hook_resid_post"], rtol=0, atol=1e-10)
    mid = mine.get_full_resid_decomposition(layer=1, mlp_input=True)
    torch.testing.assert_close(mid.sum(0), mine["blocks.1.hook_resid_mid"], rtol=0, atol=1e-10)


def test_compute_head_results_and_dict_surface(caches):
    *_, mine, theirs = caches
    mine.compute_head_results()
    theirs.compute_head_results()
    for layer in range(2):
        _close(mine[f"blocks.{layer}.attn.hook_result"], theirs[f"blocks.{layer}.attn.hook_result"], "result")
    assert len(mine) == len(list(mine.keys())) == len(list(mine.values())) == len(list(mine.items()))
    assert set(mine.keys()) <= set(theirs.keys()) | {"hook_pos_embed"}
    assert mine.to("cpu") is not None and "Activation" in repr(mine)
    try:
        mine.toggle_autodiff(False)
        assert not torch.is_grad_enabled()
    finally:
        mine.toggle_autodiff(True)


def test_logit_attrs_are_a_fold_ln_bridges(caches):
    """phaselens folds the final norm's gain into ``tokens_to_residual_directions`` (TransformerLens's fold_ln),
    so the reference is a fold_ln bridge over the same weights: same residual, folded W_U."""
    arch, model, _, tokens, mine, _ = caches
    ref = bridge_over(model.model, arch)
    ref.enable_compatibility_mode(fold_ln=True, center_writing_weights=False, center_unembed=False,
                                  fold_value_biases=False)
    _, theirs = ref.run_with_cache(tokens)
    targets, wrong = tokens[:, -1], torch.zeros_like(tokens[:, -1])
    a = mine.logit_attrs(mine.decompose_resid(pos_slice=-1), targets, pos_slice=-1)
    b = theirs.logit_attrs(theirs.decompose_resid(pos_slice=-1), targets, pos_slice=-1)
    # the bridge's fold_ln rounds through fp32 (measured 6e-9 on values ~0.05); a missing gain moves them by ~1e-2
    torch.testing.assert_close(a, b.double(), rtol=0, atol=1e-7)
    diff = mine.logit_attrs(mine.decompose_resid(pos_slice=-1), targets, wrong, pos_slice=-1)
    own = model.run_with_cache(tokens)[0][:, -1]  # the eager path the cache came from
    bias = model.b_U + (0 if getattr(model.ln_final, "bias", None) is None else model.ln_final.bias @ model.W_U)
    own = own - bias  # TransformerLens's logit_attrs leaves out biases (with fold_ln, the final norm's is in b_U)
    want = own.gather(-1, targets[:, None])[:, 0] - own.gather(-1, wrong[:, None])[:, 0]
    # attributions sum to the logit difference; transformers' LlamaRMSNorm normalises in fp32 even in an fp64 model
    # (measured 1.2e-8 here), a missing bias or gain is off by >1e-2
    torch.testing.assert_close(diff.sum(0), want, rtol=0, atol=1e-6)


def test_moe_neuron_methods_say_why():
    from tests.support.tl_reference import tiny_mixtral

    model = tiny_mixtral()
    _, cache = model.run_with_cache(torch.arange(3, 10)[None])
    for call in (lambda: cache.stack_neuron_results(2), lambda: cache.get_neuron_results(0),
                 lambda: cache.get_full_resid_decomposition(expand_neurons=True)):
        with pytest.raises(PhaseLensError, match="mixtures of experts.*expand_neurons=False"):
            call()
    assert cache.stack_head_results().shape == (8, 1, 7, 64)


def test_sliced_cache_keeps_its_kind():
    model = phaselens.load("zoo:w8s4")
    _, cache = model.run_with_cache(torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0)))
    sliced = cache.apply_slice_to_batch_dim(1)
    assert isinstance(sliced, PhaseCache) and type(ActivationCache.apply_slice_to_batch_dim(cache, 1)) is not PhaseCache
    torch.testing.assert_close(sliced.accumulated_resid(layer=1, apply_ln=True),
                               cache.accumulated_resid(layer=1, apply_ln=True)[:, 1], rtol=0, atol=0)


# ---- the zoo: the identities TransformerLens's answer satisfies ---------------------------------------------
@pytest.fixture(scope="module")
def zoo():
    model = phaselens.load("zoo:w8s4").to(torch.float64)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    logits, cache = model.run_with_cache(tokens)
    return model, tokens, logits, cache


def test_zoo_full_decomposition_sums_to_the_residual_and_logits(zoo):
    model, tokens, logits, cache = zoo
    L = model.cfg.n_layers
    parts, labels = cache.get_full_resid_decomposition(return_labels=True)
    assert labels[-1] == "bias" and labels[0] == "L0H0" and "embed" in labels
    assert parts.shape[0] == L * model.cfg.n_heads + L * model.cfg.d_mlp + 2
    torch.testing.assert_close(parts.sum(0), cache[f"blocks.{L - 1}.hook_resid_post"], rtol=0, atol=1e-10)
    heads = cache.stack_head_results()
    torch.testing.assert_close(heads.sum(0), sum(cache[f"blocks.{i}.hook_attn_out"] for i in range(L)),
                               rtol=0, atol=1e-10)
    neurons = cache.stack_neuron_results(L)
    b_out = sum(b.mlp.b_out for b in model.blocks) if model.blocks[0].mlp.b_out is not None else 0
    torch.testing.assert_close(neurons.sum(0) + b_out, sum(cache[f"blocks.{i}.hook_mlp_out"] for i in range(L)),
                               rtol=0, atol=1e-10)
    # logit attribution of the whole decomposition is the logit (the zoo's unembedding has no bias)
    t = tokens[:, -1]
    attrs = cache.logit_attrs(cache.get_full_resid_decomposition(pos_slice=-1), t, pos_slice=-1)
    torch.testing.assert_close(attrs.sum(0), logits[:, -1].gather(-1, t[:, None])[:, 0], rtol=0, atol=1e-9)
    final = cache.accumulated_resid(apply_ln=True)[-1] @ model.W_U  # the final layer is ln_final itself
    torch.testing.assert_close(final, logits, rtol=0, atol=1e-9)


def test_zoo_head_results_are_z_times_each_heads_w_o(zoo):
    model, _, _, cache = zoo
    cache.compute_head_results()
    z = cache["blocks.1.attn.hook_z"]
    for h in range(model.cfg.n_heads):
        torch.testing.assert_close(cache["blocks.1.attn.hook_result"][:, :, h], z[:, :, h] @ model.blocks[1].attn.W_O[h],
                                   rtol=0, atol=1e-12)


def test_logit_lens_ends_at_the_models_logits(zoo, caches):
    """The logit lens's last entry (the final residual through ln_final and unembed) is the model's own logits, on
    the zoo and the adapters; on hyper-connection models it says why it cannot be."""
    for _, _, logits, cache in [zoo, (caches[1], caches[3], caches[1](caches[3]), caches[4])]:
        lens = cache.logit_lens()
        assert lens.labels[-1] == "final_post" and lens.values.shape[0] == len(lens.labels)
        torch.testing.assert_close(lens.values[-1].double(), logits[:, -1].double(), rtol=0, atol=1e-6)  # last position


@pytest.mark.parametrize("kind", ["deepseek_v4", "deepseek_v41"])
def test_logit_lens_on_hyper_connections_says_why(kind, tmp_path):
    """V4 (the adapter) and V4.1 (phaselens' own) mix hyper-connection streams in hc_head before the final norm,
    so a per-layer logit lens would read a stream the model never unembeds: both refuse by name."""
    import warnings

    from tests.support.deepseek import tiny_v4_model
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "deepseek_v4":
            model = phaselens.from_hf(tiny_v4_model())
        else:
            model = phaselens.load(f"hf:{write_tiny_checkpoint(tmp_path / 'tiny')}", dtype=torch.float32,
                                   index_topk="all")
    _, cache = model.run_with_cache(torch.randint(0, model.cfg.d_vocab, (1, 8)))
    with pytest.raises(PhaseLensError, match="logit_lens does not apply.*hc_head"):
        cache.logit_lens()
