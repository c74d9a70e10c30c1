"""Fingerprints cover every parameter (name, shape, dtype, content), the config, the default task, the
adapter's analysis metadata and the other inputs of a computation; multi-GB models hash a strided sample."""

from __future__ import annotations

import copy

import pytest
import torch

import phaselens
from phaselens.contract.protocol import module_of
from phaselens.storage.fingerprints import analysis_fingerprint, fingerprint, model_fingerprint
from tests.support.models import LAYOUTS, make_model, task_model, tiny_task


def edited(model, fn):
    m = copy.deepcopy(model)
    with torch.no_grad():
        fn(m)
    return m


def test_every_single_element_of_every_tensor_counts():
    model = make_model(LAYOUTS["w8s4-deepseek"])
    base = model_fingerprint(model)
    assert model_fingerprint(copy.deepcopy(model)) == base  # content, not identity
    for name, p in model.named_parameters():
        for where in (0, p.numel() - 1, p.numel() // 2):  # first, last and a middle element
            def bump(m, name=name, where=where):
                dict(m.named_parameters())[name].view(-1)[where] += 1e-3

            assert model_fingerprint(edited(model, bump)) != base, (name, where)


def test_sampled_mode_sees_whole_tensor_edits_in_every_tensor():
    # full_limit=0 forces the multi-GB path: a strided sample of each tensor plus its shape
    model = make_model(LAYOUTS["w8s4-deepseek"])
    base = model_fingerprint(model, full_limit=0, sample=7)
    assert model_fingerprint(model, full_limit=0, sample=7) == base != model_fingerprint(model)
    for name, _ in model.named_parameters():
        def negate(m, name=name):
            p = dict(m.named_parameters())[name]
            p.copy_(-p + 0.25)  # the attack (a layer negated) plus a shift, so all-zero tensors change too

        assert model_fingerprint(edited(model, negate), full_limit=0, sample=7) != base, name


def test_zoo_reproducer_layer_and_unembedding_negated():
    model = phaselens.load("zoo:w4s4")

    def attack(m):
        for p in m.blocks[1].parameters():
            p.neg_()
        m.unembed.weight.neg_()

    assert model_fingerprint(edited(model, attack)) != model_fingerprint(model)
    assert model_fingerprint(edited(model, attack), full_limit=0) != model_fingerprint(model, full_limit=0)


def test_dtype_config_task_and_metadata_count():
    model = task_model()
    base = model_fingerprint(model)
    assert model_fingerprint(copy.deepcopy(model).double()) != base  # same values, another dtype
    other_task = copy.deepcopy(model)
    other_task.default_task = tiny_task(block_filler=5)
    assert model_fingerprint(other_task) != base
    # the same weights under another config (a smaller local window changes the logits, not the tensors)
    cfg = model.config.__class__(**{**model.config.to_dict(), "local_window": 2,
                                    "compression": model.config.compression, "rope": model.config.rope})
    rewired = phaselens.models.CompressedTransformer(cfg)
    rewired.load_state_dict(model.state_dict())
    rewired.default_task = model.default_task
    assert model_fingerprint(rewired) != base
    ens = [phaselens.phase_ensemble(model, shifts=s, combine="max_conf") for s in ("all", "opposite")]
    assert module_of(ens[0]) is model
    assert len({base, *(model_fingerprint(e) for e in ens)}) == 3  # analysis_metadata (the shifts) counts


def test_analysis_parts_count_and_are_canonical():
    model = task_model()
    cal = {0: torch.ones(3, 4, 8), 1: torch.zeros(3, 4, 8)}
    base = analysis_fingerprint(model, calibration=cal, items=torch.arange(6).reshape(2, 3), method="mean", seed=0)
    assert analysis_fingerprint(model, seed=0, method="mean", items=torch.arange(6).reshape(2, 3),
                                calibration={1: torch.zeros(3, 4, 8), 0: torch.ones(3, 4, 8)}) == base  # order-free
    cal2 = {0: torch.ones(3, 4, 8), 1: torch.zeros(3, 4, 8)}
    cal2[1][2, 3, 7] = 1e-6
    variants = [
        dict(calibration=cal2, items=torch.arange(6).reshape(2, 3), method="mean", seed=0),
        dict(calibration=cal, items=torch.arange(6).reshape(3, 2), method="mean", seed=0),  # shape
        dict(calibration=cal, items=torch.arange(6).reshape(2, 3).int(), method="mean", seed=0),  # dtype
        dict(calibration=cal, items=torch.arange(6).reshape(2, 3), method="zero", seed=0),
        dict(calibration=cal, items=torch.arange(6).reshape(2, 3), method="mean", seed=1),
        dict(calibration=cal, items=torch.arange(6).reshape(2, 3), method="mean", seed=0.0),  # type matters
    ]
    fps = {analysis_fingerprint(model, **v) for v in variants}
    assert len(fps) == len(variants) and base not in fps
    assert fingerprint(a="bc") != fingerprint(a="b", c="") and fingerprint(x=[1, 2]) != fingerprint(x=[[1, 2]])
    assert fingerprint(task=tiny_task()) == fingerprint(task=tiny_task()) != fingerprint(task=tiny_task(modulus=12))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int8])
def test_exotic_dtypes_hash(dtype):
    t = torch.arange(10).to(dtype)
    assert fingerprint(t=t) == fingerprint(t=t.clone()) != fingerprint(t=t.float())
