"""Plot functions take typed results (issue 33): plots sit a layer above results/ and read their types (under
``TYPE_CHECKING``, so ``import phaselens.plots`` stays light), never analyses/ (issue 45); a result's ``plot``
finds its figure function by name (``Result._figure``), and every such name resolves to a plot function of that
result type."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from phaselens import plots
from phaselens.results.base import Result

PLOTS = Path(plots.__file__).parent
TAKES_RESULTS = ("head_phase_heatmap", "layer_knockout_map", "patch_heatmap", "attribution_heatmap",
                 "read_side_attention", "gate_profiles", "gate_concentration", "gate_cycling_scatter",
                 "accuracy_by_residue", "phase_rose", "periodicity_panel", "repair_panel")


def _result_types() -> dict[str, type]:
    import phaselens

    return {name: getattr(phaselens, name) for name in phaselens.__all__
            if isinstance(getattr(phaselens, name), type) and issubclass(getattr(phaselens, name), Result)}


@pytest.mark.parametrize("name", TAKES_RESULTS)
def test_plot_functions_annotate_their_result(name):
    fn = getattr(plots, name)
    hints = typing.get_type_hints(fn, globalns={**fn.__globals__, **_result_types()})
    first = next(iter(inspect.signature(fn).parameters))
    kinds = typing.get_args(hints[first]) or (hints[first],)
    assert kinds and all(isinstance(k, type) and issubclass(k, Result) for k in kinds), (name, hints[first])


def _runtime_imports(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def _all_imports(tree: ast.Module) -> list[str]:
    return [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]


def test_plots_read_results_and_never_analyses():
    above = ("phaselens.analyses", "phaselens.models", "phaselens.train", "phaselens.planning",
             "phaselens.presentation")
    found = {f.name: [m for m in _all_imports(ast.parse(f.read_text())) if m.startswith(above)]
             for f in PLOTS.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    assert any(m.startswith("phaselens.results.") for f in PLOTS.glob("*.py")
               for m in _all_imports(ast.parse(f.read_text())))


def test_plots_import_result_types_only_for_annotations():
    found = {f.name: [m for m in _runtime_imports(ast.parse(f.read_text())) if m.startswith("phaselens.results")]
             for f in PLOTS.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    planted = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import phaselens.analyses.maps\n"
                        "from phaselens.results.base import Result\n")
    assert _runtime_imports(planted)[-1] == "phaselens.results.base"  # a runtime import outside the block is seen


def _figure_names(cls: type) -> list[str]:
    """The plot function names a result type's methods pass to ``Result._figure``."""
    tree = ast.parse(Path(inspect.getfile(cls)).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    def names(arg: ast.expr) -> list[str]:  # a name, or either branch of `a if cond else b`
        return names(arg.body) + names(arg.orelse) if isinstance(arg, ast.IfExp) else [ast.literal_eval(arg)]

    return [n for call in ast.walk(node) if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "_figure" for n in names(call.args[0])]


@pytest.mark.parametrize("name", sorted(_result_types()))
def test_every_result_plots_through_a_plot_function_of_its_type(name):
    cls = _result_types()[name]
    names = _figure_names(cls)
    assert names, f"{name}.plot names no plot function"
    for fn_name in names:
        fn = getattr(plots, fn_name)  # an AttributeError here: the result names a plot function that is gone
        hints = typing.get_type_hints(fn, globalns={**fn.__globals__, **_result_types()})
        first = next(iter(inspect.signature(fn).parameters))
        assert cls in (typing.get_args(hints[first]) or (hints[first],)), (name, fn_name, hints[first])


def test_a_result_naming_a_missing_plot_function_fails_loudly():
    """The planted fault: a result whose ``plot`` names a function plots does not have raises, naming it."""
    from dataclasses import dataclass

    @dataclass(frozen=True, repr=False, eq=False)
    class Planted(Result):
        metadata: dict

        def plot(self, **kwargs):
            return self._figure("no_such_figure", **kwargs)

    with pytest.raises(AttributeError, match="no_such_figure"):
        Planted({}).plot()
