"""Analyses without hidden state (issue 33): every ``Analysis`` is a frozen dataclass of its settings, no method
sets anything on ``self``, ``prepare`` returns a frozen state; the common keywords are written once and spelled
out in every public signature; a call's checks run once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

import pytest

import phaselens
import phaselens.analyses
from phaselens.analyses import runner
from phaselens.analyses.runner import N_PER_RESIDUE, Analysis, Common, CommonOptions, ResamplingOptions
from phaselens.planning.plans import analyses, public_analyses
from phaselens.results.base import Result

PUBLIC = tuple(public_analyses())  # every analysis, from the one place phaselens discovers them
HEAD_ANALYSES = ("ablate", "knockout", "patch")  # the analyses that take heads, second


def _analyses() -> list[type]:
    return list(analyses().values())


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
                                             "GateCycling", "Repair", "KnockoutEvaluation"}
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
        getattr(phaselens, name)(object(), *(["L0H0"] if name in HEAD_ANALYSES else []), n_per_residu=2)


# ---- one signature style (issue 45, item 6) ------------------------------------------------------------------
def style_violations(name: str, fn) -> list[str]:
    """How ``fn``'s signature breaks ``fn(model, [heads,] task=None, *, phase=None, n_per_residue=N_PER_RESIDUE,
    <own options>, **common) -> <a Result>`` (empty: it follows it)."""
    out = []
    params = list(inspect.signature(fn).parameters.values())
    positional = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
    want = ["model", "heads", "task"] if name in HEAD_ANALYSES else ["model", "task"]
    if positional != want:
        out.append(f"{name}: positional parameters {positional}, not {want} (everything else keyword-only)")
    by = {p.name: p for p in params}
    if "task" in by and by["task"].default is not None:
        out.append(f"{name}: task defaults to {by['task'].default!r}, not None (the model's default task)")
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    if keywords[:2] != ["phase", "n_per_residue"]:
        out.append(f"{name}: the keywords start {keywords[:2]}, not ['phase', 'n_per_residue']")
    if "phase" in by and by["phase"].default is not None:
        out.append(f"{name}: phase defaults to {by['phase'].default!r}, not None (every phase)")
    if "n_per_residue" in by and by["n_per_residue"].default != N_PER_RESIDUE:
        out.append(f"{name}: n_per_residue defaults to {by['n_per_residue'].default!r}, not N_PER_RESIDUE")
    ret = typing.get_type_hints(inspect.unwrap(fn)).get("return")
    if not (isinstance(ret, type) and issubclass(ret, Result)):
        out.append(f"{name}: returns {ret!r}, not a Result type")
    return out


def test_the_analyses_are_the_top_levels():
    """The one discovery (phaselens.planning.plans) finds every analysis phaselens exports, and only those."""
    assert set(PUBLIC) == {"evaluate", "record", "ablate", "patch", "knockout", "specialization_map",
                           "attribution_map", "gate_cycling_test", "repair_table"}
    assert set(PUBLIC) <= set(phaselens.__all__)
    assert all(getattr(phaselens, name) is fn for name, fn in public_analyses().items())


@pytest.mark.parametrize("name", PUBLIC)
def test_every_analysis_has_the_one_signature_style(name):
    assert style_violations(name, public_analyses()[name]) == []


def test_the_style_check_finds_planted_signatures():
    """Each way of breaking the style is reported (so the test above can fail)."""

    def phase_positional(model, heads, phase=None, *, task=None, n_per_residue=N_PER_RESIDUE) -> Result: ...

    def other_default(model, task=None, *, phase=None, n_per_residue=256) -> Result: ...

    def no_phase(model, task=None, *, n_per_residue=N_PER_RESIDUE, seed=0) -> Result: ...

    def not_a_result(model, task=None, *, phase=None, n_per_residue=N_PER_RESIDUE) -> dict: ...

    assert any("positional parameters ['model', 'heads', 'phase']" in v
               for v in style_violations("ablate", phase_positional))
    assert any("not N_PER_RESIDUE" in v for v in style_violations("evaluate", other_default))
    assert any("not ['phase', 'n_per_residue']" in v for v in style_violations("evaluate", no_phase))
    assert any("not a Result type" in v for v in style_violations("evaluate", not_a_result))


def test_a_signature_that_repeats_a_common_keyword_is_refused():
    from phaselens.analyses.runner import spelled_out

    def twice(model, task=None, *, n_per_residue: int = 64, **options: typing.Unpack[CommonOptions]) -> Result: ...

    with pytest.raises(TypeError, match="declares n_per_residue, which"):
        spelled_out(twice)


def test_phase_and_task_are_not_positional_past_their_place():
    """``phase`` is keyword-only everywhere: given third to a head analysis it is the task (refused, with the
    fix), and anything past ``task`` is Python's TypeError."""
    model = phaselens.load("zoo:w8s4")
    with pytest.raises(phaselens.errors.TaskError, match=r"pass them by keyword: phase=3"):
        phaselens.ablate(model, "L0H0", 3, n_per_residue=1, progress=False)
    with pytest.raises(TypeError, match="positional"):
        phaselens.ablate(model, "L0H0", None, 3)
    with pytest.raises(TypeError, match="multiple values for argument 'task'"):
        phaselens.patch(model, "L0H0", None, task=None)
    with pytest.raises(TypeError, match="positional"):
        phaselens.evaluate(model, None, 3)
    with pytest.raises(TypeError, match="positional"):
        phaselens.phase_ensemble(model, "all")


@pytest.mark.parametrize("name", PUBLIC)
def test_phase_means_the_same_everywhere(name):
    """``phase=p`` is ``residues=`` the residues of phase p, in every analysis; both at once is one InputError,
    a phase outside 0..S-1 one ResidueError, before any forward."""
    model = phaselens.load("zoo:w8s4")
    fn = public_analyses()[name]
    heads = ["L0H0"] if name in HEAD_ANALYSES else []
    with pytest.raises(phaselens.errors.InputError, match="residues or phase, not both"):
        fn(model, *heads, phase=1, residues=[1], n_per_residue=1, progress=False)
    with pytest.raises(phaselens.errors.ResidueError, match=r"outside 0\.\.3"):
        fn(model, *heads, phase=4, n_per_residue=1, progress=False)


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


def test_phase_selects_the_residues_of_those_phases():
    model = phaselens.load("zoo:w8s4")
    kw = dict(n_per_residue=2, progress=False, n_bootstrap=0, n_permutations=1)
    by_phase = phaselens.evaluate(model, phase=[1, 3], **kw).items
    M, S = 24, 4
    by_residue = phaselens.evaluate(model, residues=[r for r in range(M) if r % S in (1, 3)], **kw).items
    assert sorted(set(by_phase["residue"])) == [r for r in range(M) if r % S in (1, 3)]
    assert by_phase["correct"].tolist() == by_residue["correct"].tolist()
