"""``transformer_lens.patching`` on phaselens models (issue 46, item 3): every ``get_act_patch_*`` (direct-path
functions included) equals a ``TransformerBridge`` holding the same fp64 weights (causal-LM adapters), and a
brute-force patch written with ``run_with_hooks`` (zoo); what a kind cannot patch is a PhaseLensError saying why."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformer_lens import patching as P

import phaselens
from phaselens.errors import InputError, PhaseLensError
from phaselens.models.parts.tl_weights import SurfaceError
from tests.support.tl_reference import pair

SWEEPS = [n for n in dir(P) if n.startswith("get_act_patch") and "direct_path" not in n]


def metric(logits):
    return logits[:, -1, 5].mean() - logits[:, -1, 7].mean()


def _sweep(model, fn, clean, corrupt, **kw):
    _, cache = model.run_with_cache(clean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = getattr(P, fn)(model, corrupt, cache, metric, **kw)
    return out if isinstance(out, torch.Tensor) else out.mean()


def _direct(model, clean, corrupt, component, all_sources=False):
    _, c = model.run_with_cache(clean)
    _, k = model.run_with_cache(corrupt)
    if all_sources:
        return P.get_act_patch_direct_path_all_sources(model, corrupt, c, k, metric, component=component,
                                                       verbose=False)
    return P.get_act_patch_direct_path(model, corrupt, c, k, metric, src_layer=0, src_head=1, component=component,
                                       verbose=False)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def adapted(request):
    model, ref, tokens = pair(request.param)
    return request.param, model, ref, tokens, tokens.flip(0)


@pytest.mark.parametrize("fn", SWEEPS)
def test_every_sweep_is_the_bridges(adapted, fn):
    _, model, ref, clean, corrupt = adapted
    if fn == "get_act_patch_resid_mid":  # read-only on transformers models: the residual add does not read it
        with pytest.raises(InputError, match="read-only.*hook_attn_out or hook_resid_post"):
            _sweep(model, fn, clean, corrupt)
        return
    mine, theirs = _sweep(model, fn, clean, corrupt), _sweep(ref, fn, clean, corrupt)
    assert mine.shape == theirs.shape
    assert mine.abs().max() > 0  # the sweep moved the metric somewhere
    # TransformerLens stores results in the default float32: 1e-6 is above that rounding, far below the effects
    torch.testing.assert_close(mine.double(), theirs.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("component", ["q", "k", "v"])
def test_direct_path_is_the_bridges(adapted, component):
    arch, model, ref, clean, corrupt = adapted
    if arch == "llama" and component != "q":  # GQA: TransformerLens refuses per-query-head K/V, on both
        for m in (model, ref):
            with pytest.raises(ValueError, match="GQA"):
                _direct(m, clean, corrupt, component)
        return
    mine, theirs = _direct(model, clean, corrupt, component), _direct(ref, clean, corrupt, component)
    assert torch.all(mine[0] == 0) and mine[1].abs().max() > 0
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    if component == "q":
        every = _direct(model, clean, corrupt, component, all_sources=True)
        torch.testing.assert_close(every, _direct(ref, clean, corrupt, component, all_sources=True), rtol=0,
                                   atol=1e-6)
        torch.testing.assert_close(every[0, 1], mine, rtol=0, atol=0)


def test_fork_names_need_the_flag_and_restore_it(adapted):
    _, model, _, clean, _ = adapted
    with pytest.raises(SurfaceError, match="set_use_split_qkv_input"):
        model.run_with_hooks(clean, fwd_hooks=[("blocks.1.attn.hook_q_input", lambda x, hook: None)])
    model.set_use_split_qkv_input(True)
    try:
        seen = []
        out = model.run_with_hooks(clean, fwd_hooks=[("blocks.1.attn.hook_q_input",
                                                      lambda x, hook: seen.append(x.shape))])
        assert seen == [(*clean.shape, model.cfg.n_heads, model.cfg.d_model)]
        torch.testing.assert_close(out, model(clean), rtol=0, atol=0)  # an unedited fork changes nothing
    finally:
        model.set_use_split_qkv_input(False)


# ---- the zoo: against brute-force patches written with run_with_hooks -------------------------------------
@pytest.fixture(scope="module")
def zoo():
    model = phaselens.load("zoo:w8s4").to(torch.float64)
    clean = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    return model, clean, clean.flip(0)


def _patched(model, corrupt, hooks):
    return metric(model.run_with_hooks(corrupt, fwd_hooks=hooks)).item()


def test_zoo_sweeps_are_brute_force_patches(zoo):
    model, clean, corrupt = zoo
    _, cache = model.run_with_cache(clean)
    layer, pos, head = 1, 5, 2

    def put(name, index):
        def fn(x, hook):
            x = x.clone()
            x[index] = cache[name][index]
            return x

        return [(name, fn)]

    cells = {
        "get_act_patch_resid_pre": ((layer, pos), put("blocks.1.hook_resid_pre", (slice(None), pos))),
        "get_act_patch_resid_mid": ((layer, pos), put("blocks.1.hook_resid_mid", (slice(None), pos))),
        "get_act_patch_attn_out": ((layer, pos), put("blocks.1.hook_attn_out", (slice(None), pos))),
        "get_act_patch_mlp_out": ((layer, pos), put("blocks.1.hook_mlp_out", (slice(None), pos))),
        "get_act_patch_attn_head_out_by_pos": ((layer, pos, head),
                                               put("blocks.1.attn.hook_z", (slice(None), pos, head))),
        "get_act_patch_attn_head_out_all_pos": ((layer, head),
                                                put("blocks.1.attn.hook_z", (slice(None), slice(None), head))),
        "get_act_patch_attn_head_q_by_pos": ((layer, pos, head),
                                             put("blocks.1.attn.hook_q", (slice(None), pos, head))),
    }
    for fn, (index, hooks) in cells.items():
        sweep = _sweep(model, fn, clean, corrupt)
        assert abs(sweep[index].item() - _patched(model, corrupt, hooks)) < 1e-6, fn
    with pytest.raises(PhaseLensError, match="compressed layer.*hook_pattern_local"):
        _sweep(model, "get_act_patch_attn_head_pattern_all_pos", clean, corrupt)


def test_zoo_direct_path_is_a_two_pass_brute_force(zoo):
    """Edge (0, 1) -> (l, h) on q: the query head ``h`` computes from ``resid_pre + delta`` (pass 1: the model's
    own forward with the shifted residual), everything else from the corrupted run (pass 2)."""
    model, clean, corrupt = zoo
    _, c = model.run_with_cache(clean)
    _, k = model.run_with_cache(corrupt)
    W_O = model.blocks[0].attn.W_O[1]
    delta = c["blocks.0.attn.hook_z"][:, :, 1] @ W_O - k["blocks.0.attn.hook_z"][:, :, 1] @ W_O
    result = P.get_act_patch_direct_path(model, corrupt, c, k, metric, src_layer=0, src_head=1, verbose=False)
    for layer, head in ((1, 0), (1, 3)):
        seen = {}

        def shift(x, hook):
            return x + delta

        def grab(q, hook, head=head, seen=seen):
            seen["q"] = q[:, :, head].clone()

        model.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", shift),
                                                 (f"blocks.{layer}.attn.hook_q", grab)])

        def put(q, hook, head=head, seen=seen):
            q = q.clone()
            q[:, :, head] = seen["q"]
            return q

        want = _patched(model, corrupt, [(f"blocks.{layer}.attn.hook_q", put)])
        assert abs(result[layer, head].item() - want) < 1e-6
    assert result[1].abs().max() > 0 and torch.all(result[0] == 0)
    with pytest.raises(SurfaceError, match="hook_kv"):  # layer 1 of w8s4 is a tied K = V compressed layer
        P.get_act_patch_direct_path(model, corrupt, c, k, metric, src_layer=0, src_head=1, component="k",
                                    verbose=False)


def test_zoo_full_patches_keys_values_and_patterns():
    model = phaselens.load("zoo:full").to(torch.float64)
    clean = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    corrupt = clean.flip(0)
    every = _sweep(model, "get_act_patch_attn_head_all_pos_every", clean, corrupt)
    assert every.shape == (5, model.cfg.n_layers, model.cfg.n_heads) and every.abs().max() > 0
    _, cache = model.run_with_cache(clean)

    def put(x, hook):
        x = x.clone()
        x[:, 2] = cache["blocks.1.attn.hook_pattern"][:, 2]
        return x

    pattern = _sweep(model, "get_act_patch_attn_head_pattern_all_pos", clean, corrupt)
    assert abs(pattern[1, 2].item() - _patched(model, corrupt, [("blocks.1.attn.hook_pattern", put)])) < 1e-6
    for component in ("k", "v"):
        out = _direct(model, clean, corrupt, component)
        assert out[1].abs().max() > 0


def test_patching_refuses_a_model_in_training_mode(zoo):
    model, clean, corrupt = zoo
    model.train()
    try:
        with pytest.raises(ValueError, match="evaluation mode"):
            _sweep(model, "get_act_patch_resid_pre", clean, corrupt)
    finally:
        model.eval()


@pytest.mark.slow  # ~900 forwards of the tiny V4 (3 min on a shared CPU)
def test_deepseek_v4_runs_or_says_why_for_every_function():
    """Every patching sweep and cache method on the V4 adapter runs, or raises a PhaseLensError naming the reason
    (hyper-connection streams, grouped low-rank W_O, K = V latents, split patterns), never an error from TL."""
    from tests.support.deepseek import tiny_v4_model

    model = phaselens.from_hf(tiny_v4_model())
    clean = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    _, c = model.run_with_cache(clean)
    _, k = model.run_with_cache(clean.flip(0))
    calls = {fn: (lambda fn=fn: _sweep(model, fn, clean, clean.flip(0))) for fn in SWEEPS}
    calls["direct_path"] = lambda: P.get_act_patch_direct_path(model, clean.flip(0), c, k, metric, 0, 0, verbose=False)
    calls.update({
        "decompose_resid": c.decompose_resid, "stack_head_results": c.stack_head_results,
        "stack_neuron_results": lambda: c.stack_neuron_results(1),
        "get_full_resid_decomposition": c.get_full_resid_decomposition,
        "logit_attrs": lambda: c.logit_attrs(c["blocks.0.hook_resid_post"][None], clean[:, -1]),
    })
    ran, refused = [], []
    for name, call in calls.items():
        try:
            call()
            ran.append(name)
        except PhaseLensError as err:
            assert len(str(err)) > 60, name  # a reason, not a bare name
            refused.append(name)
    assert {"get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos", "get_act_patch_block_every"} <= set(ran)
    assert {"direct_path", "decompose_resid", "stack_neuron_results", "logit_attrs"} <= set(refused)


# ---- TransformerLens's own contracts of the sweeps, on phaselens kinds ------------------------------------
def _kinds():
    model, _, tokens = pair("gpt2")
    zoo_model = phaselens.load("zoo:w8s4").to(torch.float64)
    zoo_tokens = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    return {"gpt2": (model, tokens), "zoo": (zoo_model, zoo_tokens)}


@pytest.fixture(scope="module")
def kinds():
    return _kinds()


def per_example(logits):
    return logits[:, -1, 5] - logits[:, -1, 7]


@pytest.mark.parametrize("kind", ["gpt2", "zoo"])
def test_per_example_values_baseline_and_batched_direct_path(kinds, kind):
    """TL's test_per_example_values_match_single_example_sweeps, test_baseline_effect_and_normalization and
    test_batched_sweep_patches_every_example, on a causal-LM adapter and the zoo."""
    model, clean = kinds[kind]
    corrupt = clean.flip(0)
    _, cache = model.run_with_cache(clean)
    _, kcache = model.run_with_cache(corrupt)
    result = P.get_act_patch_attn_head_out_all_pos(model, corrupt, cache, per_example, reduce="none", baseline=True)
    for b in range(2):
        single = P.get_act_patch_attn_head_out_all_pos(model, corrupt[b:b + 1], cache.apply_slice_to_batch_dim(
            (b, b + 1)), per_example, reduce="none")
        torch.testing.assert_close(result.values[..., b], single.values[..., 0], rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(result.baseline, per_example(model(corrupt)).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(result.effect(), result.values - result.baseline, rtol=0, atol=1e-6)

    def summed(logits):
        return per_example(logits).sum()

    batched = P.get_act_patch_direct_path(model, corrupt, cache, kcache, summed, 0, 1, verbose=False)
    each = sum(P.get_act_patch_direct_path(model, corrupt[i:i + 1], cache.apply_slice_to_batch_dim((i, i + 1)),
                                           kcache.apply_slice_to_batch_dim((i, i + 1)), summed, 0, 1, verbose=False)
               for i in range(2))
    torch.testing.assert_close(batched, each, rtol=0, atol=1e-5)
