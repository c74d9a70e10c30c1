"""Every model object is a valid input: a transformers model, an nnsight envoy, a TransformerLens bridge (and the model
it rewired) and ``hf:DIR`` give the same numbers, to ``phaselens.load`` and to every analysis, and the user's object
is left as it was. A bridged DeepSeek-V4 model is measured through its original modules (never NaN readings)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import InputError, PhaseLensError, UnsupportedModelError
from phaselens.tasks import KVRecall
from tests.support.causal_lm import Snapshot, boot_bridge, tiny_causal_lm

TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)  # vocabulary 128
SMALL = dict(n_per_residue=1, progress=False, stride=4)


def _numbers(model) -> dict[str, np.ndarray]:
    ev = phaselens.evaluate(model, TASK, **SMALL, n_permutations=1, n_bootstrap=0)
    ab = phaselens.ablate(model, "L1H1", task=TASK, method="zero", **SMALL, n_bootstrap=0)
    pm = phaselens.specialization_map(model, TASK, method="zero", kinds=("head",), **SMALL, n_bootstrap=0)
    rec = phaselens.record(model, TASK, **SMALL)
    return {"logit_diff": ev.items["logit_diff"].to_numpy(), "ko": ab.items["logit_diff_ko"].to_numpy(),
            "map": np.asarray(pm.logit_diff_ko), "local": rec.values["local"]}


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    for key in a:
        assert np.allclose(a[key], b[key], atol=tol, rtol=tol, equal_nan=True), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("objects")
    hf = tiny_causal_lm("llama", seed=7)
    hf.save_pretrained(root / "tiny-llama")
    return root, hf, _numbers(phaselens.load(f"hf:{root / 'tiny-llama'}", stride=4))


def test_a_transformers_object_equals_hf_dir(saved):
    _, hf, ref = saved
    before = Snapshot.of(hf)
    _close(_numbers(hf), ref)  # every analysis takes the object itself (stride= from the analysis)
    _close(_numbers(phaselens.load(hf, stride=4)), ref)
    before.assert_same(hf)


def test_an_nnsight_envoy_equals_hf_dir(saved):
    import nnsight

    root, _, ref = saved
    hf = tiny_causal_lm("llama", seed=7)
    envoy = nnsight.NNsight(hf)
    before = Snapshot.of(hf)
    _close(_numbers(envoy), ref)
    assert phaselens.load(envoy, stride=4).model is hf
    before.assert_same(hf)


def test_a_transformer_lens_bridge_and_its_model_equal_hf_dir(saved, tmp_path):
    _, _, ref = saved
    hf = tiny_causal_lm("llama", seed=7)
    bridge = boot_bridge(hf, tmp_path / "tok")
    before = Snapshot.of(hf)  # as the bridge left it (rewired in place, eager attention)
    for obj in (bridge.original_model, bridge):
        model = phaselens.load(obj, stride=4)
        assert "TransformerLens bridge" in model.analysis_metadata["source"]
        _close(_numbers(model), ref)
        _close(_numbers(obj), ref)
    before.assert_same(hf)


def test_objects_without_a_route_are_refused_with_one(saved):
    root, hf, _ = saved
    with pytest.raises(InputError, match=r"stride="):
        phaselens.evaluate(hf, TASK, n_per_residue=1, progress=False)
    with pytest.raises(InputError, match=r"stride="):
        phaselens.load(f"hf:{root / 'tiny-llama'}")
    with pytest.raises(InputError, match="unknown keyword"):
        phaselens.load(f"hf:{root / 'tiny-llama'}", stride=4, chunk=8)
    with pytest.raises(UnsupportedModelError, match="phaselens.load"):
        phaselens.load(torch.nn.Linear(2, 2))
    with pytest.raises(PhaseLensError, match="phaselens.load"):
        phaselens.load(object())
    with pytest.raises(UnsupportedModelError, match=r"stride=4"):
        phaselens.evaluate(object(), TASK, n_per_residue=1, progress=False)
    with pytest.raises(InputError, match="device"):
        phaselens.load(hf, stride=4, device="cuda")


def test_a_deepseek_v4_object_routes_to_its_adapter():
    from phaselens.models.causal_lm import from_transformers
    from tests.support.deepseek import tiny_v4_model

    hf = tiny_v4_model(seed=3)
    opts = dict(n_per_residue=1, progress=False, n_permutations=1, n_bootstrap=0)
    ref = phaselens.evaluate(phaselens.from_hf(hf), TASK, **opts)
    assert type(phaselens.load(hf)).__name__ == "DeepSeekV4Adapter"
    got = phaselens.evaluate(hf, TASK, **opts)  # the object itself: no stride needed, the model has its own
    assert np.allclose(got.items["logit_diff"], ref.items["logit_diff"], atol=1e-5)
    with pytest.raises(UnsupportedModelError, match="compressed model"):
        from_transformers(hf, stride=4)


def test_a_bridged_deepseek_v4_is_measured_through_its_original_modules(tmp_path):
    """Booting a TransformerLens bridge over DeepSeek-V4 replaces every self_attn; the adapter reads the model
    through a view with the original modules, so record's readings are the model's own (not NaN)."""
    from tests.support.deepseek import VOCAB, tiny_v4_model

    opts = dict(n_per_residue=1, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = phaselens.record(phaselens.from_hf(tiny_v4_model(seed=3)), TASK, **opts)
        hf = tiny_v4_model(seed=3)
        bridge = boot_bridge(hf, tmp_path / "tok", vocab=VOCAB)
        assert "transformer_lens" in type(hf.model.layers[1].self_attn).__module__  # rewired in place
        for obj in (bridge.original_model, bridge):
            rec = phaselens.record(phaselens.from_hf(obj), TASK, **opts)
            for q in ("entries", "key_entries", "local"):
                got, want = rec.values[q], ref.values[q]
                assert np.isfinite(got[:, 1:]).all(), q  # layer 0 is sliding-only: no entries there
                assert np.allclose(got, want, atol=1e-5, equal_nan=True), q
