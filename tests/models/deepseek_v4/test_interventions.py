"""DeepSeek-V4 adapter interventions: knockouts through torch hooks and through nnsight, and no leaks."""

from __future__ import annotations

import pytest
import torch

from phaselens.analyses.knockouts import knocked_out
from phaselens.models.deepseek_v4 import from_transformers
from tests.support.deepseek import (
    one_thread,  # noqa: F401  (autouse fixture)
    random_tokens,
    tiny_v4_model,
)

T = 21


@pytest.fixture(scope="module")
def v4():
    return tiny_v4_model(seed=1)


@pytest.fixture(scope="module")
def adapters(v4):
    return {"torch": from_transformers(v4), "nnsight": from_transformers(v4, backend="nnsight")}


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(3)
    return random_tokens(3, T, g), random_tokens(8, T, g)  # tokens, calibration


def state(model: torch.nn.Module) -> dict:
    """Everything a hook, a tap or nnsight could leave behind on the model or in transformers."""
    from torch.nn.modules import module as torch_module
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    per_module = {
        name: (
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks),
            dict(m._backward_hooks),
            dict(m._backward_pre_hooks),
            dict(m._forward_hooks_with_kwargs),
            dict(m._forward_pre_hooks_with_kwargs),
            frozenset(m.__dict__),
            m.forward.__func__ if hasattr(m.forward, "__func__") else m.forward,
        )
        for name, m in model.named_modules()
    }
    return {
        "modules": per_module,
        "eager": hf.eager_attention_forward,
        "registry": (dict(ALL_ATTENTION_FUNCTIONS._local_mapping), dict(AttentionInterface._global_mapping)),
        "impl": model.config._attn_implementation,
        "global_hooks": (
            dict(torch_module._global_forward_hooks),
            dict(torch_module._global_forward_pre_hooks),
        ),
    }


@pytest.mark.parametrize(
    "heads, method",
    [
        (["L1H0", "L3H2"], "zero"),
        (["L1H0", "L3H2"], "mean"),
        ("L2", "zero"),
        ("L2", "mean"),
        ((0, 3), "resample"),
    ],
)
def test_knockout_parity_nnsight_vs_torch_hooks(adapters, data, heads, method):
    tokens, calibration = data
    logits = {}
    with torch.no_grad():
        clean = adapters["torch"](tokens)
        assert torch.equal(adapters["nnsight"](tokens), clean)
        for backend, adapter in adapters.items():
            with knocked_out(adapter, heads, method=method, calibration=calibration, seed=5):
                logits[backend] = adapter(tokens)
    assert torch.equal(logits["torch"], logits["nnsight"])
    assert (logits["torch"] - clean)[:, -1].abs().max() > 1e-3  # the query position changed
    assert torch.equal(logits["torch"][:, :-1], clean[:, :-1])  # and nothing before it


def test_knockout_is_at_z_before_the_output_projection(adapters, data):
    """Zeroing a head at hook_z equals zeroing its slice of o_a_proj's input: not the mixed output."""
    tokens, _ = data
    a = adapters["torch"]
    model = a.model
    d = a.cfg.d_head

    def zero_slice(module, args):
        x = args[0].clone()  # [B, n, groups, heads_per_group * d]; head 3 is group 1, second slot
        x[:, -1, 1, d : 2 * d] = 0
        return (x,)

    handle = model.model.layers[1].self_attn.o_a_proj.register_forward_pre_hook(zero_slice)
    try:
        with torch.no_grad():
            ref = model(tokens).logits
    finally:
        handle.remove()
    with torch.no_grad(), knocked_out(a, "L1H3", method="zero"):
        ours = a(tokens)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("backend", ["torch", "nnsight"])
def test_module_sites_agree_across_backends(adapters, data, backend):
    tokens, _ = data
    names = [
        "hook_embed",
        "blocks.1.hook_resid_pre",
        "blocks.1.attn.hook_q",
        "blocks.1.attn.hook_kv",
        "blocks.1.attn.hook_indexer_topk",
        "blocks.1.attn.hook_z",
        "blocks.2.hook_attn_out",
        "blocks.2.hook_resid_mid",
        "blocks.2.hook_mlp_out",
        "blocks.3.hook_resid_post",
        "blocks.2.attn.hook_gate",
    ]
    with torch.no_grad():
        _, ref = adapters["torch"].run_with_cache(tokens, names_filter=names)
        _, got = adapters[backend].run_with_cache(tokens, names_filter=names)
    assert sorted(got) == sorted(names)
    for name in names:
        assert torch.equal(got[name], ref[name]), name
    # Replacing a module site through nnsight edits the model as the torch hook does.
    edit = [("blocks.2.hook_mlp_out", lambda x, hook: x * 0), ("blocks.1.attn.hook_q", lambda q, hook: q * 2)]
    with torch.no_grad():
        assert torch.equal(
            adapters[backend].run_with_hooks(tokens, fwd_hooks=edit),
            adapters["torch"].run_with_hooks(tokens, fwd_hooks=edit),
        )


class Boom(Exception):
    pass


def _raise(kind: type[BaseException]):
    def fn(tensor, *, hook):
        raise kind(hook.name)

    return fn


@pytest.mark.parametrize("backend", ["torch", "nnsight"])
@pytest.mark.parametrize("kind", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["hook_z", "hook_gate", "hook_pattern", "with_block"])
def test_no_hooks_remain_after_errors(adapters, data, backend, kind, where):
    tokens, _ = data
    a = adapters[backend]
    model = a.model
    with torch.no_grad():
        clean = a(tokens)
    before = state(model)
    sites = {
        "hook_z": "blocks.1.attn.hook_z",
        "hook_gate": "blocks.2.attn.hook_gate",
        "hook_pattern": "blocks.3.attn.hook_pattern_entry",
    }
    keep = [(name, lambda t, *, hook: None) for name in sites.values()]  # live hooks on every kind of site
    with pytest.raises(kind):
        with a.hooks(fwd_hooks=keep), torch.no_grad():
            if where == "with_block":
                a(tokens)
                raise kind("inside the user's block")
            a.run_with_hooks(tokens, fwd_hooks=[(sites[where], _raise(kind))])
    assert state(model) == before
    assert a._active == []
    with torch.no_grad():
        assert torch.equal(a(tokens), clean)


def test_no_hooks_remain_after_the_model_raises_inside_the_nnsight_trace(adapters, data):
    """The forward itself fails while nnsight is interleaving (here: a module raises mid-forward)."""
    tokens, _ = data
    a = adapters["nnsight"]
    before = state(a.model)

    def fail(module, args, out):
        raise Boom("the model failed mid-forward")

    mlp = a.model.model.layers[2].mlp
    handle = mlp.register_forward_hook(fail)  # the test's own hook, removed below
    try:
        with pytest.raises(Boom):
            a.run_with_hooks(
                tokens,
                fwd_hooks=[
                    ("blocks.1.attn.hook_z", lambda z, hook: z * 0),
                    ("blocks.3.attn.hook_z", lambda z, hook: None),
                ],
            )
    finally:
        handle.remove()
    assert state(a.model) == before


def test_an_envoy_passed_in_is_used_and_left_to_its_owner(data):
    """``from_transformers(nnsight_envoy, backend="nnsight")``: the user's own wrapper (how an NDIF LanguageModel would
    come in; the remote run itself is untested) drives the trace, and its controllers stay installed."""
    import nnsight

    tokens, _ = data
    model = tiny_v4_model(seed=1)
    plain = from_transformers(model)
    with torch.no_grad(), knocked_out(plain, "L1H2", method="zero"):
        ref = plain(tokens)
    envoy = nnsight.NNsight(model)
    wrapped = {id(m): set(m.__dict__) for m in model.modules()}
    a = from_transformers(envoy, backend="nnsight")
    assert a.model is model
    with torch.no_grad(), knocked_out(a, "L1H2", method="zero"):
        assert torch.equal(a(tokens), ref)
    assert {id(m): set(m.__dict__) for m in model.modules()} == wrapped
