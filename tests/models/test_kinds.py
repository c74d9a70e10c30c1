"""The registry of model kinds (phaselens.models.kinds) is what ``phaselens.load`` and the object adapter read: a kind
planted there is the one they use, every kind's declared capabilities are its model class's, and one module-level
``from_hf`` remains in phaselens."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import phaselens
from phaselens.contract.protocol import CAPABILITIES
from phaselens.errors import InputError, UnsupportedModelError
from phaselens.models import kinds
from phaselens.models.kinds import KINDS, Kind
from tests.support.causal_lm import tiny_causal_lm

PACKAGE = Path(phaselens.__file__).parent
SEEN: list[tuple[str, str]] = []


def planted_load(source: str, *, device: str = "cpu", colour: str = "red") -> str:
    SEEN.append((source, colour))
    return f"planted {source}"


@pytest.mark.parametrize("name", sorted(KINDS))
def test_declared_capabilities_are_the_model_class_methods(name):
    kind = KINDS[name]
    cls = kinds.resolve(kind.model)
    assert set(kind.capabilities) <= set(CAPABILITIES), kind.capabilities
    assert set(kind.capabilities) == {c for c in CAPABILITIES if hasattr(cls, c)}, name


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_entry_resolves(name):
    kind = KINDS[name]
    assert callable(kind.loader())
    assert kind.adapt is None or callable(kind.adapter())
    assert "device" in kind.load_options()
    assert name in repr(kind)


def test_load_dispatches_through_the_registry(monkeypatch):
    """A kind planted under the zoo's scheme gets the zoo source, and the kind's loader is what ``load`` returns."""
    SEEN.clear()
    monkeypatch.setitem(KINDS, "zoo", Kind("zoo", "a planted kind", KINDS["zoo"].model,
                                           "tests.models.test_kinds:planted_load", schemes=("zoo:",)))
    assert phaselens.load("zoo:anything") == "planted anything"
    assert SEEN == [("anything", "red")]


def test_an_hf_folder_goes_to_the_kind_that_claims_its_model_type(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "planted_type"}')
    monkeypatch.setitem(KINDS, "planted", Kind("planted", "a planted checkpoint", KINDS["zoo"].model,
                                               "tests.models.test_kinds:planted_load", model_types=("planted_type",)))
    SEEN.clear()
    assert phaselens.load(f"hf:{tmp_path}", colour="blue") == f"planted {tmp_path}"
    assert SEEN == [(str(tmp_path), "blue")]
    with pytest.raises(InputError, match=r"unknown keyword.*'shade'.*a planted checkpoint accepts colour, device"):
        phaselens.load(f"hf:{tmp_path}", shade="blue")


def test_the_object_adapter_reads_the_registry(monkeypatch):
    """A model object goes to the kind that claims its model_type: one claimed by a kind without an adapter is
    refused by name, and without the planted claim the same object is a causal LM."""
    hf = tiny_causal_lm("llama", seed=1)
    monkeypatch.setitem(KINDS, "planted", Kind("planted", "a planted kind", KINDS["zoo"].model,
                                               "tests.models.test_kinds:planted_load", model_types=("llama",)))
    with pytest.raises(UnsupportedModelError, match="is a planted kind, which phaselens builds itself"):
        phaselens.load(hf, stride=4)
    monkeypatch.delitem(KINDS, "planted")
    model = phaselens.load(hf, stride=4)
    assert type(model).__name__ == "CausalLMAdapter"
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape[-1] == hf.config.vocab_size


def test_the_kinds_with_compression_are_not_causal_lms():
    assert set(kinds.compressed_model_types()) == {"deepseek_v4", "deepseek_v41"}
    assert kinds.by_model_type("gpt2").name == "causal_lm"
    assert kinds.by_model_type("deepseek_v41").name == "deepseek_v41"


def test_one_module_level_from_hf():
    defined = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        defined += [str(path.relative_to(PACKAGE)) for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "from_hf"]
    assert defined == ["models/objects.py"]
