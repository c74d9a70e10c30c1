"""Raw exceptions become PhaseLensErrors that name the fix (issue "Reliability round 4", class 2).

* A user hook's return value, at every hook point of tiny models and through every way of adding a hook
  (``run_with_hooks``, the ``hooks`` context, ``model.add_hook``): a wrong shape, dtype, device or type is an
  ``InputError`` naming the hook point, the expected shape and dtype and what came back (before, a list was an
  AttributeError, a double tensor a matmul error, a broadcastable shape was silently broadcast). Hooks never
  leak: after the error the model has no hooks and its logits are unchanged.
* ``specialization_map(kinds=("kv_head",))`` on a model without GQA sharing maps each KV head (its one query
  head) instead of failing on an empty table.
* A compressed KV cache used with another batch says how to get a cache for it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.analyses.maps import map_cells
from phaselens.errors import CacheError, InputError
from tests.support.models import LAYOUTS, make_model, task_model

MODELS = {
    "zoo:w4s4": lambda: phaselens.load("zoo:w4s4"),
    "tied-kv-vector-swiglu": lambda: make_model(LAYOUTS["w8s4-deepseek"], qk_norm=True, mlp="swiglu"),
    "control-gqa": lambda: make_model(None),
}
_cache: dict[str, tuple] = {}


def setup(kind: str) -> tuple:
    """``(model, tokens, clean logits, {hook name: the value it sees})``, built once per model."""
    if kind not in _cache:
        model = MODELS[kind]()
        tokens = torch.randint(0, model.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(0))
        clean, acts = model.run_with_cache(tokens)
        _cache[kind] = (model, tokens, clean, {name: acts[name] for name in model.hook_dict})
    return _cache[kind]


def names(kind: str) -> list[tuple[str, str]]:
    return [(kind, name) for name in setup(kind)[0].hook_dict]


WRONG = {  # what a buggy hook returns, and how the message names it
    "list": (lambda v: v.tolist(), "list"),
    "numpy": (lambda v: v.detach().numpy(), "ndarray"),
    "extra axis": (lambda v: v.unsqueeze(0), "shape (1, "),
    "first row only": (lambda v: v[:1], "shape (1"),  # batch 2: broadcast silently before
    "float64": (lambda v: v.double(), "torch.float64"),
    "int64": (lambda v: v.long(), "torch.int64"),
    "meta device": (lambda v: v.to("meta"), "on meta"),
}


APIS = ("run_with_hooks", "hooks context", "add_hook", "run_with_hooks(reset_hooks_end=False)")


def _apply(model, tokens, how: str, name: str, fn) -> None:
    if how == "run_with_hooks":
        model.run_with_hooks(tokens, fwd_hooks=[(name, fn)])
    elif how == "run_with_hooks(reset_hooks_end=False)":
        model.run_with_hooks(tokens, fwd_hooks=[(name, fn)], reset_hooks_end=False)
    elif how == "hooks context":
        with model.hooks(fwd_hooks=[(name, fn)]):
            model(tokens)
    else:
        model.add_hook(name, fn)
        model(tokens)


@pytest.mark.parametrize("kind,name", [p for kind in MODELS for p in names(kind)])
def test_a_wrong_hook_return_names_the_point_and_what_was_expected_and_leaves_no_hook(kind, name):
    model, tokens, clean, acts = setup(kind)
    value = acts[name]
    # every wrong return through one way of adding a hook each (in turn), and one through every way
    cases = [(label, APIS[i % len(APIS)]) for i, label in enumerate(WRONG)] + [("list", how) for how in APIS[1:]]
    for label, how in cases:
        make, shown = WRONG[label]
        with pytest.raises(InputError) as info:
            _apply(model, tokens, how, name, lambda v, hook, make=make: make(v))
        text = str(info.value)
        assert name in text and str(tuple(value.shape)) in text and str(value.dtype) in text, text
        assert shown in text, (label, how, text)
        assert not any(hp.fwd_hooks or hp.bwd_hooks for hp in model.hook_dict.values()), (label, how)
    assert torch.equal(model(tokens), clean)


@pytest.mark.parametrize("kind", list(MODELS))
def test_hooks_that_read_or_replace_correctly_still_work(kind):
    model, tokens, clean, acts = setup(kind)
    z = "blocks.1.attn.hook_z"
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda v, hook: None)]), clean)
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda v, hook: v)]), clean)
    zeroed = model.run_with_hooks(tokens, fwd_hooks=[(z, lambda v, hook: torch.zeros_like(v))])
    assert zeroed.shape == clean.shape and not torch.equal(zeroed, clean)
    model.add_hook(z, lambda v, hook: torch.zeros_like(v))  # a persistent hook stays until it is removed
    try:
        assert torch.equal(model(tokens), zeroed)
    finally:
        model.reset_hooks()
    assert torch.equal(model(tokens), clean)


# ---- specialization_map(kinds=("kv_head",)) without GQA sharing ---------------------------------------------
def test_kv_head_cells_without_sharing_are_the_heads():
    dims = type("D", (), dict(n_layers=2, n_heads=4, n_key_value_heads=4))
    kv = map_cells(dims, ("kv_head",))
    assert list(kv["label"]) == [f"L{layer}KV{k}" for layer in range(2) for k in range(4)]
    assert [tuple(h) for h in kv["heads"]] == [(k,) for _ in range(2) for k in range(4)]
    assert set(map_cells(dims, ("head", "kv_head"))["kind"]) == {"head"}  # no duplicate cells
    gqa = map_cells(type("D", (), dict(n_layers=1, n_heads=4, n_key_value_heads=2)), ("kv_head",))
    assert [tuple(h) for h in gqa["heads"]] == [(0, 1), (2, 3)]


def test_a_kv_head_map_of_a_model_without_sharing_equals_its_head_map():
    model = task_model(n_kv_heads=4)
    kw = dict(n_per_residue=1, n_bootstrap=10, progress=False, engine="full")
    kv = phaselens.specialization_map(model, kinds=("kv_head",), **kw)
    heads = phaselens.specialization_map(model, kinds=("head",), **kw)
    assert list(kv.cells["kind"].unique()) == ["kv_head"]
    assert np.array_equal(kv.correct_ko, heads.correct_ko)
    assert np.array_equal(kv.logit_diff_ko, heads.logit_diff_ko)
    assert kv.values("kv_head").values.shape == heads.values("head").values.shape
    with pytest.raises(InputError, match="KV heads are its heads"):
        heads.values("kv_head")


# ---- a cache used with another batch ----------------------------------------------------------------------
def test_a_cache_of_another_batch_says_how_to_get_one():
    model, tokens, clean, _ = setup("zoo:w4s4")
    cache = model.new_cache(batch_size=1, max_len=64)
    model(tokens[:1, :8], cache=cache)
    with pytest.raises(CacheError, match=r"model\.new_cache\(batch_size=2, max_len=64\).*cache\.reset\(\)"):
        model(tokens[:, 8:12], cache=cache)
    out = model(tokens[:1, 8:], cache=cache)  # the refused call left the cache as it was
    assert torch.allclose(out, clean[:1, 8:], atol=1e-5)
    assert model.new_cache(batch=2, max_len=64).batch_size == 2
