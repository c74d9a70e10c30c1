"""One rule for a stride, wherever it is given (issue 44, class 3; docs/concepts.md, "Strides: one rule").

An adapter re-adapted at another stride is re-adapted and records it; an analysis's ``stride=`` reads phases at
it and the result records it; a model with compression accepts its own strides and their multiples and refuses
any other stride with the same error from every route (load option, analysis keyword, load of a built model).
"""

from __future__ import annotations

import warnings

import pytest

import phaselens
from phaselens.contract.strides import check_stride, compression_strides
from phaselens.errors import InputError, PhaseGeometryError
from tests.support.causal_lm import tiny_causal_lm
from tests.support.models import tiny_task

Q = dict(n_per_residue=2, progress=False, n_bootstrap=0, n_permutations=1)


@pytest.fixture(scope="module")
def hf():
    return tiny_causal_lm("qwen3", seed=2)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "ckpt")


def _load_v41(ckpt, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return phaselens.load(f"hf:{ckpt}", **kw)


def test_reloading_an_adapter_at_another_stride_re_adapts_it(hf):
    """load(load(hf, stride=4), stride=8) was the stride-4 adapter, silently."""
    a4 = phaselens.load(hf, stride=4)
    a8 = phaselens.load(a4, stride=8)
    assert a8 is not a4 and a8.model is a4.model  # the same transformers model, never copied
    assert (a8.analysis_spec.stride, a8.analysis_spec.window, a8.analysis_metadata["analysis_stride"]) == (8, 8, 8)
    assert a4.analysis_spec.stride == 4 and a4.analysis_metadata["analysis_stride"] == 4  # the old one unchanged
    assert phaselens.load(a4) is a4 and phaselens.load(a4, stride=4) is a4
    assert phaselens.load(a4, stride=8, origin=1).analysis_spec.origin == 1


def test_an_analysis_at_another_stride_records_the_stride_it_read(hf):
    """evaluate(adapter_at_4, stride=8) computed at 8 but recorded analysis_stride 4."""
    a4 = phaselens.load(hf, stride=4)
    ev = phaselens.evaluate(a4, tiny_task(), stride=8, **Q)
    assert ev.stride == 8 and ev.metadata["analysis_stride"] == 8
    assert ev.metadata["arguments"]["stride"] == 8 and set(ev.items["phase"]) == set(range(8))


def test_a_compressed_model_reads_a_multiple_of_its_stride_and_records_both():
    model = phaselens.load("zoo:w4s4")
    assert compression_strides(model) == (4,)
    ev = phaselens.evaluate(model, stride=8, **Q)
    assert ev.stride == 8 and ev.metadata["analysis_stride"] == 8 and ev.metadata["model_analysis_stride"] == 4
    assert "model_analysis_stride" not in phaselens.evaluate(model, **Q).metadata


@pytest.mark.parametrize("stride", [3, 6, 1, 2])
def test_a_compressed_model_refuses_a_stride_that_mixes_its_phases_everywhere(stride):
    model = phaselens.load("zoo:w4s4")
    with pytest.raises(PhaseGeometryError) as analysis:
        phaselens.evaluate(model, stride=stride, **Q)
    with pytest.raises(PhaseGeometryError) as loading:
        phaselens.load(model, stride=stride)
    assert str(analysis.value) == str(loading.value)  # one message
    assert f"stride={stride} does not fit w4s4" in str(analysis.value) and "[4]" in str(analysis.value)


def test_load_of_a_built_compressed_model_at_another_fitting_stride_names_the_routes():
    model = phaselens.load("zoo:w4s4")
    assert phaselens.load(model, stride=4) is model
    with pytest.raises(InputError, match=r"stride=8 to the analysis.*analysis_stride=8"):
        phaselens.load(model, stride=8)


def test_v41_load_option_and_analysis_keyword_follow_the_same_rule(v41):
    """specialization_map(V4.1, stride=4) folded at 4 while load(..., analysis_stride=4) was refused."""
    model = _load_v41(v41)
    assert compression_strides(model) == (2,)
    at4 = _load_v41(v41, analysis_stride=4)
    assert at4.analysis_spec.stride == 4 and at4.analysis_metadata["analysis_stride"] == 4
    batch = tiny_task().build(phaselens.PhaseSpec(4), n_per_residue=1, seed=0)
    pm = phaselens.plan(model, "specialization_map", batch, stride=4, progress=False)
    assert pm.items == len(batch)
    messages = []
    for call in (lambda: _load_v41(v41, analysis_stride=3),
                 lambda: phaselens.plan(model, "specialization_map", batch, stride=3, progress=False)):
        with pytest.raises(PhaseGeometryError) as info:
            call()
        messages.append(str(info.value))
    assert all("=3 does not fit" in m and "strides [2]" in m for m in messages), messages


@pytest.mark.parametrize("bad", [True, 0, -4, 2.5, "4"])
def test_a_stride_is_an_integer_of_at_least_one_everywhere(hf, bad):
    with pytest.raises(InputError, match="stride"):
        check_stride(bad, ())
    with pytest.raises(InputError, match="stride"):
        phaselens.load(phaselens.load(hf, stride=4), stride=bad)
