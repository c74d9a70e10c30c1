"""Plot functions take typed results (issue 33): plots sit below the analyses, so they import the result types
under ``TYPE_CHECKING`` only, for their annotations, and never at run time."""

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


def test_plots_import_result_types_only_for_annotations():
    upward = ("phaselens.analyses", "phaselens.results", "phaselens.models", "phaselens.train")
    found = {f.name: [m for m in _runtime_imports(ast.parse(f.read_text())) if m.startswith(upward)]
             for f in PLOTS.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    planted = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import phaselens.analyses.maps\n"
                        "from phaselens.results.base import Result\n")
    assert _runtime_imports(planted)[-1] == "phaselens.results.base"  # a runtime import outside the block is seen
