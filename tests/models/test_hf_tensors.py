"""Issue 44, class 1 for ``hf:`` directories: a transformers checkpoint that lacks a whole layer's tensors (or
holds unexpected ones) is refused with their names on every kind loaded through transformers, unless the user
asks for transformers' behaviour with ``strict=False``; and round 4's leftovers of saved models."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import phaselens
from phaselens.errors import CheckpointError, InputError
from phaselens.models.parts.loading_info import CheckpointMismatchWarning
from tests.support.causal_lm import tiny_causal_lm


def drop_layer(d, layer, prefix):
    """Remove every tensor of one layer (and add a stray one), as a shard lost in a copy leaves it."""
    tensors = load_file(str(d / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith(f"{prefix}{layer}.")}
    assert len(kept) < len(tensors)
    kept["model.stray.weight"] = torch.zeros(3)
    save_file(kept, str(d / "model.safetensors"), metadata={"format": "pt"})
    return sorted(set(tensors) - set(kept))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "qwen3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_causal_lm("qwen3").save_pretrained(d)
    return d


def test_a_causal_lm_without_a_layer_is_refused_by_name(qwen3_dir, tmp_path):
    good = phaselens.load(f"hf:{qwen3_dir}", stride=4)
    d = tmp_path / "broken"
    shutil.copytree(qwen3_dir, d)
    gone = drop_layer(d, 1, "model.layers.")
    with pytest.raises(CheckpointError) as err:
        phaselens.load(f"hf:{d}", stride=4)
    msg = str(err.value)
    assert f"{len(gone)} missing tensor(s): {', '.join(gone[:4])}" in msg
    assert "1 unexpected tensor(s): model.stray.weight" in msg and "pass strict=False" in msg
    # asked for explicitly: transformers' behaviour (the layer initialised at random), with a warning naming it
    with pytest.warns(CheckpointMismatchWarning, match="strict=False.*model.layers.1"):
        loose = phaselens.load(f"hf:{d}", stride=4, strict=False)
    tokens = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(loose(tokens), good(tokens))  # what strict=True protects from
    with pytest.raises(InputError, match="strict='no' must be True"):
        phaselens.load(f"hf:{d}", stride=4, strict="no")


def test_a_deepseek_v4_without_a_layer_is_refused_unless_asked(tmp_path):
    from tests.support.deepseek import tiny_v4_model

    d = tmp_path / "v4"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_v4_model().save_pretrained(d)
    drop_layer(d, 1, "model.layers.")  # (transformers fuses some of them: it counts the model's names)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model.layers.1.*stray.*strict=False"):
        phaselens.load(f"hf:{d}")
    with pytest.warns(CheckpointMismatchWarning, match="model.layers.1"):
        phaselens.load(f"hf:{d}", strict=False)


def test_hf_of_a_folder_phaselens_saved_says_to_drop_the_prefix(tmp_path):
    from tests.support.models import task_model

    task_model().save(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"names a model phaselens saved .* phaselens.load\('.*m'\), without 'hf:'"):
        phaselens.load(f"hf:{tmp_path / 'm'}")  # was: "holds a None checkpoint"
    from phaselens.models.deepseek_v4 import load_hf

    with pytest.raises(CheckpointError, match="it is a model phaselens saved"):
        load_hf(tmp_path / "m")


def test_a_saved_model_rewritten_as_int32_is_refused_not_cast(tmp_path):
    from tests.support.models import task_model

    task_model().save(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(path),
              metadata={"format": "phaselens.compressed_transformer/1"})  # rewritten without its checksums
    with pytest.raises(CheckpointError, match=r"not floating point: .*\(int32\).*is not cast"):
        phaselens.load(tmp_path / "m")
