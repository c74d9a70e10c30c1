"""engine="auto" checks the architecture before it picks the query-suffix engine (issue 44, class 4).

Gemma-2 alternates sliding-window and full-attention layers; the suffix engine's passes crashed there with a raw
size mismatch once the prefix outgrew the window. Now ``engine="auto"`` runs full forwards and records why,
``engine="suffix"`` is an :class:`EngineError` naming ``engine='full'``, and architectures whose layers share one
attention kind keep the engine. Tiny random models from configs, no downloads.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import EngineError, NotApplicableError
from tests.support.causal_lm import tiny_causal_lm
from tests.support.models import tiny_task

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
Q = dict(n_per_residue=1, progress=False, n_bootstrap=0)


def _hf(config):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def gemma2():
    """Gemma-2's layout: layer 0 a sliding window of 8 slots, layer 1 full attention (the task is ~60 slots)."""
    import transformers as tf

    hf = _hf(tf.Gemma2Config(**COMMON, sliding_window=8))
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    return phaselens.load(hf, stride=4)


def test_the_adapter_names_why_the_engine_cannot_run(gemma2):
    why = gemma2.query_engine_support()
    assert "mixes sliding-window (window 8) and full-attention layers" in why and "Gemma2ForCausalLM" in why
    with pytest.raises(EngineError, match="engine='full'"):
        gemma2.query_engine(torch.randint(3, 128, (2, 24)), torch.tensor([20, 23]))


def test_auto_runs_full_forwards_and_records_why(gemma2):
    task = tiny_task()
    auto = phaselens.specialization_map(gemma2, task, kinds=("head",), method="zero", **Q)
    full = phaselens.specialization_map(gemma2, task, kinds=("head",), method="zero", engine="full", **Q)
    assert auto.metadata["engine"] == "full" and "mixes sliding-window" in auto.metadata["engine_reason"]
    assert "engine_reason" not in full.metadata  # asked for: nothing to explain
    assert np.allclose(auto.values("head").values, full.values("head").values, equal_nan=True)
    ab = phaselens.ablate(gemma2, "L1H0", task=task, method="zero", **Q)
    assert ab.metadata["engine"] == "full" and "mixes sliding-window" in ab.metadata["engine_reason"]


@pytest.mark.parametrize("call", ["map", "ablate", "patch"])
def test_an_explicit_suffix_engine_that_cannot_run_is_a_named_error(gemma2, call):
    task = tiny_task()
    run = {"map": lambda: phaselens.specialization_map(gemma2, task, kinds=("head",), engine="suffix", **Q),
           "ablate": lambda: phaselens.ablate(gemma2, "L1H0", task=task, engine="suffix", **Q),
           "patch": lambda: phaselens.patch(gemma2, "L1", task=task, engine="suffix", **Q)}[call]
    with pytest.raises(EngineError) as info:
        run()
    assert isinstance(info.value, NotApplicableError)  # what a missing engine raised before: still caught alike
    assert "engine='suffix' cannot run here" in str(info.value) and "engine='full'" in str(info.value)


def test_qwen2_with_max_window_layers_mixes_kinds_too():
    import transformers as tf

    hf = _hf(tf.Qwen2Config(**COMMON, sliding_window=8, use_sliding_window=True, max_window_layers=1))
    assert len(set(hf.config.layer_types)) == 2
    assert "mixes sliding-window" in phaselens.load(hf, stride=4).query_engine_support()


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_architectures_with_one_attention_kind_keep_the_engine(arch):
    """Full attention everywhere, or one sliding window everywhere (Mistral): the engine runs and auto picks it."""
    model = phaselens.load(tiny_causal_lm(arch, seed=1), stride=4)
    assert model.query_engine_support() is None
    pm = phaselens.specialization_map(model, tiny_task(), kinds=("layer",), method="zero", **Q)
    assert pm.metadata["engine"] == "suffix" and "engine_reason" not in pm.metadata
