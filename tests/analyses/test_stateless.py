"""Analyses without hidden state (issue 33): every ``Analysis`` is a frozen dataclass of its settings, no method
sets anything on ``self``, ``prepare`` returns a frozen state; the common keywords are written once and spelled
out in every public signature; a call's checks run once."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import textwrap
import typing

import pytest

import phaselens
import phaselens.analyses
from phaselens.analyses import runner
from phaselens.analyses.runner import Analysis, Common, CommonOptions, ResamplingOptions

PUBLIC = ("evaluate", "specialization_map", "ablate", "patch", "attribution_map", "record", "gate_cycling_test",
          "repair_table")


def _analyses() -> list[type]:
    for pkg in ("analyses", "repair"):
        for mod in pkgutil.iter_modules(importlib.import_module(f"phaselens.{pkg}").__path__):
            importlib.import_module(f"phaselens.{pkg}.{mod.name}")
    out, todo = [], list(Analysis.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return [c for c in out if c.__module__.startswith("phaselens.")]


def _self_assignments(cls: type) -> list[str]:
    """``self.x = ...`` (also augmented, annotated, ``setattr(self, ...)``, ``object.__setattr__``) in ``cls``'s methods."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        found.append(f"{cls.__name__}.{fn.name}: self.{sub.attr} =")
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("setattr", "object.__setattr__") and node.args and ast.unparse(node.args[0]) == "self":
                    found.append(f"{cls.__name__}.{fn.name}: {name}(self, ...)")
    return found


def _is_frozen_dataclass(cls: type) -> bool:
    params = cls.__dict__.get("__dataclass_params__")  # its own decorator, not one inherited
    return params is not None and params.frozen


def violations(cls: type) -> list[str]:
    """What makes ``cls`` an analysis with hidden state (empty: none)."""
    out = _self_assignments(cls)
    if not _is_frozen_dataclass(cls):
        out.append(f"{cls.__name__} is not a frozen dataclass")
    hint = typing.get_type_hints(cls.prepare).get("return") if "prepare" in cls.__dict__ else None
    if hint is not None and not (isinstance(hint, type) and _is_frozen_dataclass(hint)):
        out.append(f"{cls.__name__}.prepare returns {hint!r}, not a frozen dataclass")
    return out


def test_every_analysis_is_stateless():
    classes = _analyses()
    assert {c.__name__ for c in classes} >= {"Evaluation", "Map", "Ablation", "Patching", "Attribution", "Record",
                                             "GateCycling", "Repair"}
    assert [v for c in classes for v in violations(c)] == []


def test_the_check_finds_planted_state():
    """Each way of keeping state on the analysis is reported (so the test above can fail)."""

    class SetsInCheck(Analysis):
        name, stage = "planted", "planted"

        def check(self, model, options):
            self.used = "full"
            return self

    @dataclasses.dataclass(frozen=True)
    class SetsInPrepare(Analysis):
        name, stage = "planted", "planted"

        def prepare(self, run):
            object.__setattr__(self, "cal", None)

    @dataclasses.dataclass(frozen=True)
    class DictState(Analysis):
        name, stage = "planted", "planted"

        def prepare(self, run) -> dict:
            return {}

    assert any("self.used =" in v for v in violations(SetsInCheck))
    assert any("not a frozen dataclass" in v for v in violations(SetsInCheck))
    assert any("object.__setattr__" in v for v in violations(SetsInPrepare))
    assert any("prepare returns" in v for v in violations(DictState))


def test_a_frozen_analysis_refuses_state_at_run_time():
    from phaselens.analyses.evaluation import Evaluation

    with pytest.raises(dataclasses.FrozenInstanceError):
        Evaluation(100).n_permutations = 5  # type: ignore[misc]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_signatures_spell_out_the_common_keywords(name):
    """The common keywords are written once (``CommonOptions``), yet every public signature shows each one
    with its type and Common's default, and has no ``**`` left."""
    fn = getattr(phaselens, name)
    sig = inspect.signature(fn)
    assert all(p.kind is not p.VAR_KEYWORD for p in sig.parameters.values())
    raw = inspect.signature(inspect.unwrap(fn)).parameters
    keywords = ResamplingOptions if "Unpack[ResamplingOptions]" in str(list(raw.values())[-1]) else CommonOptions
    defaults = {f.name: f.default for f in dataclasses.fields(Common)}
    for key in typing.get_type_hints(keywords):
        p = sig.parameters[key]
        assert p.kind is p.KEYWORD_ONLY and p.default == defaults[key] and p.annotation is not p.empty, (name, key)
    assert "n_per_residue" in sig.parameters and sig.parameters["n_per_residue"].default >= 1
    assert ("n_bootstrap" in sig.parameters) == (name not in ("attribution_map", "record"))


@pytest.mark.parametrize("name", PUBLIC)
def test_an_unknown_keyword_is_a_type_error(name):
    with pytest.raises(TypeError, match="n_per_residu"):
        getattr(phaselens, name)(object(), *(["L0H0"] if name == "ablate" else []), n_per_residu=2)


def test_common_is_built_from_the_arguments_by_keyword():
    args = {"n_per_residue": 3, "residues": [1], "seed": 2, "batch_size": 5, "stride": None, "progress": False,
            "journal": None, "method": "zero"}
    assert Common.of(args) == Common(n_per_residue=3, residues=[1], seed=2, batch_size=5, progress=False,
                                     n_bootstrap=0)
    assert Common.of({**args, "n_bootstrap": 7, "phase": 1}).n_bootstrap == 7


def test_checks_run_once_with_one_error_type(monkeypatch):
    """``run`` checks the model and the options once; building the items checks nothing again."""
    import phaselens.analyses.items as items

    calls = []
    real = runner.check_model
    monkeypatch.setattr(runner, "check_model", lambda m: calls.append(m) or real(m))
    assert not hasattr(items, "check_model")
    model = phaselens.load("zoo:w8s4")
    with pytest.raises(phaselens.errors.InputError, match="residues or phase, not both"):
        phaselens.ablate(model, "L0H0", phase=1, residues=[1], progress=False)
    assert len(calls) == 1
    with pytest.raises(phaselens.errors.InputError, match="seed"):
        phaselens.evaluate(model, n_per_residue=1, seed=-1, progress=False)
    assert len(calls) == 2
