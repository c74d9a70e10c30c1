"""``phaselens.load`` refuses an unknown keyword and a dtype that is not a floating one, for every kind of source,
with an InputError naming the argument and what the source accepts, before anything is read (a raw TypeError,
ValueError or RuntimeError from transformers or torch before)."""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.errors import InputError
from phaselens.models.deepseek_v4 import load_hf
from phaselens.models.deepseek_v41 import load_v41


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{kind: (source, a keyword it accepts)}``: one source of every kind ``load`` takes."""
    from tests.support.deepseek import tiny_v4_model
    from tests.support.deepseek_v41 import write_tiny_checkpoint
    from tests.support.models import LAYOUTS, make_model

    root = tmp_path_factory.mktemp("sources")
    make_model(LAYOUTS["w4s4-scalar"]).save(root / "saved")
    tiny_v4_model().save_pretrained(root / "v4")
    return {
        "zoo": ("zoo:w4s4", "device"),
        "saved": (str(root / "saved"), "device"),
        "hf-v4": (f"hf:{root / 'v4'}", "layer_types"),
        "hf-v41": (f"hf:{write_tiny_checkpoint(root / 'v41')}", "index_topk"),
        "served": ("http://127.0.0.1:9/v1", "tokenizer"),  # nothing listens: refused before any request
    }


KINDS = ["zoo", "saved", "hf-v4", "hf-v41", "served"]
BAD = {"unknown keyword": ({"foo": 1}, "foo"), "int32 dtype": ({"dtype": torch.int32}, "dtype"),
       "float8 dtype": ({"dtype": torch.float8_e4m3fn}, "dtype")}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_argument_is_an_input_error_naming_it_and_what_is_accepted(sources, kind, bad):
    source, accepted = sources[kind]
    kwargs, named = BAD[bad]
    with pytest.raises(InputError) as err:
        phaselens.load(source, **kwargs)
    message = str(err.value)
    assert named in message, message
    dtype_refused = kind.startswith("hf") and named == "dtype"  # hf: takes dtype, and lists the floating ones
    assert ("torch.bfloat16" in message and "torch.float32" in message) if dtype_refused else accepted in message


@pytest.mark.parametrize("kwargs", [{"foo": 1}, {"dtype": torch.int32}])
def test_hf_arguments_are_refused_before_anything_is_read(tmp_path, kwargs):
    """A directory whose config.json is not JSON (or no directory at all) still gets the argument's error."""
    (tmp_path / "config.json").write_text("{not json")
    for source in (f"hf:{tmp_path}", f"hf:{tmp_path / 'absent'}"):
        with pytest.raises(InputError, match="foo|dtype"):
            phaselens.load(source, **kwargs)


def test_a_keyword_of_the_other_deepseek_is_refused_by_name(sources):
    with pytest.raises(InputError, match=r"\['layer_types'\].*DeepSeek-V4.1 checkpoint .*accepts .*index_topk"):
        phaselens.load(sources["hf-v41"][0], layer_types=["sliding_attention"])
    with pytest.raises(InputError, match=r"\['index_topq'\] \(did you mean 'index_topk'\?\)"):
        phaselens.load(sources["hf-v4"][0], index_topq=4)


def test_the_loaders_refuse_bad_arguments_when_called_directly(sources):
    v4, v41 = sources["hf-v4"][0][3:], sources["hf-v41"][0][3:]
    with pytest.raises(InputError, match=r"load_hf got the unknown keyword argument\(s\) \['foo'\]"):
        load_hf(v4, foo=1)
    for dtype in (torch.int32, "int32", torch.float8_e4m3fn):
        with pytest.raises(InputError, match="dtype=.*not a dtype DeepSeek-V4 computes in"):
            load_hf(v4, dtype=dtype)
        with pytest.raises(InputError, match="dtype=.*not a dtype DeepSeek-V4.1 computes in"):
            load_v41(v41, dtype=dtype)
