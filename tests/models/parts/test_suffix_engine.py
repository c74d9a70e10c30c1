"""Every suffix engine subclasses the one base (phaselens.models.parts.suffix_engine.SlotEngine): found by reading
every module of phaselens, and seen on the engines a zoo model and a causal LM build."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import phaselens
from phaselens.errors import InputError
from phaselens.models.parts.suffix_engine import QueryEngine, SlotEngine, query_engine
from tests.support.causal_lm import tiny_causal_lm
from tests.support.models import LAYOUTS, make_model

PACKAGE = Path(phaselens.__file__).parent


def _engine_classes() -> list[tuple[str, str]]:
    """``(module, class)`` of every class in phaselens that runs layers for query rows (defines ``run_layers``) or
    is named like a suffix engine."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = "phaselens." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in ("SlotEngine", "QueryEngine") and (
                    node.name.endswith("SuffixEngine")
                    or any(isinstance(f, ast.FunctionDef) and f.name == "run_layers" for f in node.body)):
                found.append((module, node.name))
    return found


def test_every_suffix_engine_subclasses_the_one_base():
    import importlib

    engines = _engine_classes()
    assert len(engines) >= 4, engines  # the zoo's, V4's, V4.1's and the causal LM's
    for module, name in engines:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, SlotEngine), f"{module}.{name}"
        assert "run_layers" in vars(cls), f"{module}.{name} runs no layers of its own"
        # the shared loop is the base's alone: no kind writes its own cell grouping or pass loop again
        for shared in ("run", "cell_rows", "cells_per_pass", "clean_step"):
            assert shared not in vars(cls), f"{module}.{name} redefines SlotEngine.{shared}"


@pytest.mark.parametrize("kind", ["zoo", "causal_lm"])
def test_the_engines_a_model_builds_are_the_base(kind):
    torch.manual_seed(0)
    if kind == "zoo":
        model = make_model(LAYOUTS["w4s4-scalar"])
    else:
        model = phaselens.load(tiny_causal_lm("llama", seed=1), stride=4)
    tokens = torch.randint(0, 32, (3, 12))
    engine = model.query_engine(tokens, torch.tensor([11, 7, 11]))
    assert isinstance(engine, QueryEngine)
    assert [len(rows) for rows, _ in engine.groups] == [1, 2]
    assert all(isinstance(eng, SlotEngine) for _, eng in engine.groups)


def test_the_one_query_engine_refuses_active_hooks():
    model = make_model(LAYOUTS["w4s4-scalar"])
    sig = inspect.signature(query_engine)
    assert sig.parameters["hooks_active"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(InputError, match="cannot honour hooks that are active"):
        query_engine(model, SlotEngine, torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), hooks_active=True)
