"""The package's layers: imports point one way, no cycles, a small top level, a public namespace.

The layers, lowest first (docs/architecture.md). A module may import from its own layer and from lower ones;
``analyses`` and ``models`` share a rank but never import each other (they meet only in the contract).
Imports are read from the source: module-level, function-level and ``TYPE_CHECKING`` imports all count (an
annotation is a dependency too).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import phaselens

PKG = Path(phaselens.__file__).resolve().parent

# first package component under phaselens -> rank
LAYERS = {
    "core": 0, "data": 0, "errors": 0,
    "stats": 1, "tasks": 1,
    "contract": 2,
    "runtime": 3, "storage": 3, "parallel": 3,
    "results": 4,  # every result type
    "plots": 5,  # figures of results: plots read results, never analyses
    "analyses": 6, "models": 6,
    "planning": 7, "repair": 7,  # plans read models (through the contract) and what analyses declare they run
    "train": 8, "integrations": 8,
    "presentation": 9,
    "__init__": 10, "__main__": 10,
}
SIBLINGS = {frozenset({"analyses", "models"})}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from pkg import name` the package itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            # a module's own ancestors are skipped (its package's __init__), except the top package: nothing
            # below it may import `phaselens` itself (the check that could not fire before)
            if t and t != name and (t == "phaselens" or not name.startswith(t + ".")):
                out.add(t)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, set(mods)) for m, f in mods.items()}


def test_every_subpackage_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops <= set(LAYERS), f"give these a layer in LAYERS and docs/architecture.md: {tops - set(LAYERS)}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up a layer, between siblings, or at the top package."""
    bad = []
    for src, targets in graph.items():
        ls = _layer(src)
        for dst in targets:
            ld = _layer(dst)
            if dst == "phaselens" or ld == ls:
                if dst == "phaselens" and ls != "__init__":
                    bad.append(f"{src} imports the top package (import from the defining module instead)")
                continue
            if LAYERS[ld] > LAYERS[ls]:
                bad.append(f"{src} ({ls}) imports {dst} ({ld}): upward")
            elif frozenset({ls, ld}) in SIBLINGS:
                bad.append(f"{src} ({ls}) imports {dst} ({ld}): siblings meet only through the contract")
    return sorted(bad)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_imports_point_down(graph):
    bad = upward_imports(graph)
    assert not bad, "\n".join(bad)


# Issue 45, Part A (the model layer) breaks this one; it is exempt, exactly as it is, until that merges (then
# delete it): the compressed transformer, its cache, its query engine and its file I/O import each other.
def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


# phaselens.models.parts: what every model kind shares (hook sites and their dispatch, the suffix-engine base,
# norms, RoPE, FP8/FP4 formats, ...); models.numerics: bytes of dtypes and modules (sizing)
SHARED = ("parts", "numerics")


def _model_package(module: str) -> str | None:
    """``phaselens.models.<package>.…`` -> ``<package>`` (a kind, or a shared one); ``None`` elsewhere."""
    parts = module.split(".")
    is_package = len(parts) > 2 and parts[1] == "models" and (PKG / "models" / parts[2] / "__init__.py").exists()
    return parts[2] if is_package else None


def _kinds() -> set[str]:
    return {p.name for p in (PKG / "models").iterdir() if (p / "__init__.py").exists()} - set(SHARED)


def cross_kind_imports(graph: dict[str, set[str]], kinds: set[str]) -> list[str]:
    """What breaks the models layer's rule: a kind that imports another kind or a module of models/ outside the
    parts (the registry, ``load``, ...), or a shared package that imports a kind or anything above the parts."""
    bad = []
    for src, targets in graph.items():
        own = _model_package(src)
        if own is None:
            continue
        for dst in targets:
            if not dst.startswith("phaselens.models."):
                continue
            other = _model_package(dst)
            if own in SHARED and other not in SHARED:
                bad.append(f"{src} (shared parts) imports {dst}: the parts sit below every kind")
            elif own in kinds and other != own and other not in SHARED:
                bad.append(f"{src} ({own}) imports {dst} ({other or 'models'}): kinds share code through "
                           "models.parts (and contract, core), never import each other")
    return sorted(bad)


def test_model_kinds_share_code_only_through_the_parts(graph):
    """models/: every kind (a package) imports only itself, models.parts (and the layers below models); the parts
    import no kind and nothing of models/ above them (the registry, ``load``, the ensemble)."""
    kinds = _kinds()
    assert {"compressed", "causal_lm", "deepseek_v4", "deepseek_v41", "served"} <= kinds
    bad = cross_kind_imports(graph, kinds)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, check, fires", [
    # the top package imported from below: the check that could not fire before
    ("import phaselens\n", upward_imports, "imports the top package"),
    ("from phaselens import load\n", upward_imports, "imports the top package"),
    ("from phaselens.presentation.cli import app\n", upward_imports, "upward"),
    ("from phaselens.analyses import evaluation\n", upward_imports, "siblings"),
    ("from phaselens.models.deepseek_v41 import config\n", cross_kind_imports, "never import each other"),
    ("from phaselens.models.sources import load\n", cross_kind_imports, "never import each other"),
    ("from phaselens.models.kinds import KINDS\n", cross_kind_imports, "never import each other"),
])
def test_each_check_fires_on_a_planted_violation(graph, source, check, fires):
    """Every rule above, run on the real graph plus one planted module (phaselens.models.deepseek_v4.planted)
    that breaks it: the rule reports the planted module."""
    planted = "phaselens.models.deepseek_v4.planted"
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "planted.py"
        f.write_text(source)
        known = set(graph) | {planted}
        g = {**graph, planted: _imports(planted, f, known)}
    found = check(g) if check is upward_imports else check(g, _kinds())
    assert any(planted in line and fires in line for line in found), found
    assert not any(planted in line for line in (check(graph) if check is upward_imports else check(graph, _kinds())))


def test_the_cycle_check_fires_on_a_planted_cycle(graph):
    a, b = "phaselens.core.checks", "phaselens.core.planted"
    g = {**graph, b: {a}, a: graph[a] | {b}}
    assert [a, b] in import_cycles(g) and not import_cycles(graph) == [[a, b]]


@pytest.mark.parametrize("how", ["module", "function", "type_checking"])
def test_every_kind_of_import_closes_a_cycle(graph, how):
    """A planted module imported by ``phaselens.core.checks`` that imports it back at module level, inside a
    function, or only under ``TYPE_CHECKING``: each is a cycle (annotations are dependencies too)."""
    import tempfile

    a, planted = "phaselens.core.checks", "phaselens.core.planted"
    source = {"module": "from phaselens.core.checks import as_int\n",
              "function": "def f():\n    from phaselens.core.checks import as_int\n",
              "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from phaselens.core.checks import as_int\n"}[how]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "planted.py"
        f.write_text(source)
        g = {**graph, planted: _imports(planted, f, set(graph) | {planted}), a: graph[a] | {planted}}
    assert [a, planted] in import_cycles(g)


def test_a_small_top_level():
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert len(modules) <= 6, modules


def test_no_module_is_named_like_a_public_function():
    public = {n for n in phaselens.__all__ if callable(getattr(phaselens, n, None)) and n[0].islower()}
    clash = [str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if f.stem in public]
    clash += [str(d.relative_to(PKG)) for d in PKG.rglob("*") if d.is_dir() and d.name in public]
    assert not clash, clash


def test_a_narrow_public_surface():
    """What a notebook user types, 30 names at most; the rest lives in its subpackage, and asking the top level
    for it says where (issue 45: phaselens.errors, phaselens.models, ...)."""
    assert len(phaselens.__all__) <= 30, sorted(phaselens.__all__)
    assert "PhaseLensError" in phaselens.__all__ and "plan" in phaselens.__all__
    assert phaselens.errors.InputError.__module__ == "phaselens.errors"
    assert not hasattr(phaselens, "models.zoo") and not hasattr(phaselens, "no_such_name")  # AttributeError only
    for name, home in [("InputError", "phaselens.errors"), ("CompressedTransformer", "phaselens.models")]:
        with pytest.raises(AttributeError, match=f"lives in {home}"):
            getattr(phaselens, name)


def test_dir_shows_only_the_public_api():
    names = set(dir(phaselens))
    assert names == set(phaselens.__all__)
    for private in ("Any", "sys", "importlib", "TYPE_CHECKING", "annotations", "types"):
        assert private not in names
    for name in phaselens.__all__:  # every advertised name resolves
        assert getattr(phaselens, name) is not None


def test_no_compatibility_layer_for_unreleased_paths():
    """phaselens has never been released: no import hook aliases old module paths."""
    import sys

    import phaselens  # noqa: F401

    assert not any(type(f).__module__.startswith("phaselens") for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        import phaselens.interventions  # noqa: F401


def test_the_catalogue_and_the_package_import_without_torch():
    """``import phaselens`` and ``phaselens zoo list``'s catalogue stay light (start-up is benchmarked in
    benchmarks/bench_import.py; this keeps the heavy imports from coming back)."""
    import subprocess

    code = ("import sys, phaselens, phaselens.models.zoo as z; z.list_models(); "
            "print(sorted(m for m in ('torch', 'transformers', 'transformer_lens', 'scipy', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
