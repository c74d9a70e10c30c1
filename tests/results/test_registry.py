"""A result file cannot run code: loading rebuilds only the closed registry of result and value types, each
after its fields are checked against its declaration.

The property test crafts skeletons (named classes inside and outside the registry, old-style module paths,
fields of every shape) and loads each under two independent monitors: a ``sys.addaudithook`` hook that sees
every process spawn, write, delete, import and ``exec``, and a profiler that sees every Python call. Whatever a
file holds, ``load`` either returns registered types or raises a ``PhaseLensError``, spawns and writes
nothing, and calls no phaselens code outside the loader except the methods of a registered type.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import phaselens
from phaselens.results import registry, storage
from phaselens.results.base import Result

for _module in set(registry.TYPES.values()):  # every registered type imported, its annotations resolved
    __import__(_module)
for _name in registry.TYPES:
    registry.declared(registry.resolve(_name))

LOADER = {"phaselens/results/storage.py", "phaselens/results/registry.py", "phaselens/results/__init__.py",
          "phaselens/results/base.py", "phaselens/storage/resumable.py",
          "phaselens/storage/checksums.py"}  # the arrays' sha256, checked before they are used
FORBIDDEN = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "subprocess.Popen", "os.remove",
             "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate", "shutil.rmtree", "socket.", "ctypes.",
             "exec", "compile", "import", "builtins.input", "os.symlink", "os.link", "os.utime")
_AUDIT: list[list] = []  # the events of the load under watch (an audit hook cannot be removed: it is gated)


def _audit(event: str, args: tuple) -> None:
    if _AUDIT and event.startswith(FORBIDDEN):
        _AUDIT[-1].append((event, str(args)[:120]))
    elif _AUDIT and event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+"):
        _AUDIT[-1].append((event, str(args)[:120]))
    elif _AUDIT and event == "open" and isinstance(args[2], int) and args[2] & 0o3:  # O_WRONLY / O_RDWR
        _AUDIT[-1].append((event, str(args)[:120]))


sys.addaudithook(_audit)


def _registered_method(code) -> bool:
    name = code.co_qualname.split(".")[0]
    return name in registry.TYPES and code.co_filename.endswith(registry.TYPES[name].replace(".", "/") + ".py")


def watched_load(path: Path):
    """``phaselens.results.load(path)`` with the monitors on: (outcome, forbidden events, foreign calls)."""
    foreign: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        rel = code.co_filename.split("/phaselens/", 1)[-1]
        if "/phaselens/" not in code.co_filename or f"phaselens/{rel}" in LOADER:
            return
        f = frame
        while f is not None:  # inside a registered type's own method (its checks): allowed
            if _registered_method(f.f_code):
                return
            f = f.f_back
        foreign.append(f"{rel}:{code.co_qualname}")

    _AUDIT.append([])
    sys.setprofile(profile)
    try:
        try:
            outcome = phaselens.results.load(path)
        except Exception as err:  # noqa: BLE001 (the property classifies every outcome)
            outcome = err
    finally:
        sys.setprofile(None)
        events = _AUDIT.pop()
    return outcome, events, foreign


def write(tmp: Path, skeleton, arrays=None, fmt: str = storage.FORMAT) -> Path:
    path = tmp / "crafted.r"
    save_file(arrays if arrays is not None else {"a0": np.arange(3.0)}, str(path),
              metadata={"format": fmt, "skeleton": json.dumps(skeleton)})
    return path


def _walk(obj):
    yield obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(k)
            yield from _walk(v)
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from _walk(x)


# ---- the attacks of the report, by name ----------------------------------------------------------------------
@pytest.mark.parametrize("name, fields", [
    ("phaselens.storage.writing:atomic_write_text", {"path": "VICTIM", "text": "owned"}),
    ("phaselens.storage.writing:os.system", {"command": "touch MARKER"}),
    ("phaselens.storage.writing:atomic_write_text", {}),
    ("os:system", {"command": "touch MARKER"}),
    ("phaselens.core.heads:Head", {"layer": 1, "head": 2}),  # the old module-path form, even of a real type
    ("atomic_write_text", {"path": "VICTIM", "text": "owned"}),
])
def test_a_file_naming_code_writes_and_runs_nothing(tmp_path, name, fields, monkeypatch):
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "VICTIM"
    victim.write_text("mine")
    fields = {k: (str(victim) if v == "VICTIM" else v) for k, v in fields.items()}
    path = write(tmp_path, {"__dataclass__": name, "fields": fields})
    outcome, events, foreign = watched_load(path)
    assert isinstance(outcome, phaselens.errors.ResultFileError), outcome
    assert "not one of phaselens' result types" in str(outcome)
    assert victim.read_text() == "mine" and not (tmp_path / "MARKER").exists()
    assert events == [] and foreign == []


def test_a_file_of_the_earlier_format_is_refused_not_rebuilt(tmp_path):
    path = write(tmp_path, {"__dataclass__": "phaselens.core.heads:Head", "fields": {"layer": 1, "head": 2}},
                 fmt="phaselens.result/1")
    with pytest.raises(phaselens.errors.ResultFileError, match="development version"):
        phaselens.results.load(path)


# ---- fields checked against the declaration --------------------------------------------------------------
@pytest.mark.parametrize("fields, named", [
    ({"layer": 1, "head": 2, "shell": "rm -rf /"}, "unknown field(s) 'shell'"),
    ({"layer": 1}, "missing field(s) 'head'"),
    ({"layer": "1", "head": 2}, "Head.layer holds a str"),
    ({"layer": True, "head": 2}, "Head.layer holds a bool"),
    ({"layer": 1.5, "head": 2}, "Head.layer holds a float"),
    ({"layer": -1, "head": 2}, "does not hold a valid Head"),  # the type's own check
])
def test_fields_are_checked_against_the_declaration(tmp_path, fields, named):
    with pytest.raises(phaselens.errors.ResultFileError, match=named.replace("(", r"\(").replace(")", r"\)")):
        phaselens.results.load(write(tmp_path, {"__dataclass__": "Head", "fields": fields}))


def test_a_nested_value_of_another_type_is_named(tmp_path):
    good = phaselens.evaluate(phaselens.load("zoo:w4s4"), n_per_residue=2, seed=0, progress=False,
                              n_permutations=10, n_bootstrap=10).save(tmp_path / "ev.r")
    from safetensors.numpy import load_file

    from phaselens.storage.resumable import safetensors_metadata

    meta = safetensors_metadata(good, fix="")
    skeleton = json.loads(meta["skeleton"])
    skeleton["fields"]["tests"] = {"__dataclass__": "Head", "fields": {"layer": 0, "head": 0}}
    with pytest.raises(phaselens.errors.ResultFileError, match="PhaseEval.tests holds a Head"):
        phaselens.results.load(write(tmp_path, skeleton, load_file(str(good))))
    skeleton["fields"]["items"] = {"__array__": "a999"}
    with pytest.raises(phaselens.errors.ResultFileError, match="names the array 'a999'"):
        phaselens.results.load(write(tmp_path, skeleton, load_file(str(good))))


def test_saving_a_dataclass_outside_the_registry_is_refused(tmp_path):
    @dataclasses.dataclass(frozen=True)
    class Mine:
        x: int

    with pytest.raises(phaselens.errors.InputError, match="only phaselens' result and value types"):
        storage.save_result({"mine": Mine(1)}, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_the_registry_is_every_type_a_result_holds():
    """The closed set is exactly the dataclasses reachable from the result types' declarations."""
    seen: set[type] = set()

    def visit(hint):
        for arg in typing.get_args(hint):
            visit(arg)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint not in seen:
            seen.add(hint)
            for h in registry.declared(hint)[0].values():
                visit(h)

    results = [c for c in _subclasses(Result)]
    assert len(results) == 8
    for cls in results:
        visit(cls)
    assert {c.__qualname__ for c in seen} == set(registry.TYPES)
    for c in seen:
        assert registry.resolve(c.__qualname__) is c


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# ---- the property ----------------------------------------------------------------------------------------
NAMES = st.sampled_from([*registry.TYPES, "phaselens.storage.writing:atomic_write_text", "os:system",
                         "phaselens.storage.writing:os.system", "builtins:eval", "subprocess:Popen", "evaluate",
                         "phaselens.analyses.evaluation:evaluate", "PhaseEval.load", "Head.__init__", "__init__",
                         "Result", "phaselens.core.heads:Head", "load", "TYPES"]) | st.text(max_size=30)
FIELD_NAMES = st.sampled_from(["layer", "head", "name", "statistic", "df", "pvalue", "values", "dims", "coords",
                               "metadata", "path", "text", "command", "__class__", "__init__"]) | st.text(max_size=8)
SCALARS = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=12)


def _skeletons(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.builds(lambda n, f: {"__dataclass__": n, "fields": f}, NAMES, st.dictionaries(FIELD_NAMES, children,
                                                                                         max_size=4)),
        st.builds(lambda n, f: {"__namedtuple__": n, "fields": f}, NAMES, st.lists(children, max_size=3)),
        st.builds(lambda k: {"__array__": k}, st.sampled_from(["a0", "a1", "../a0", ""]) | st.integers()),
        st.builds(lambda x: {"__tuple__": x}, st.lists(children, max_size=3)),
        st.builds(lambda x: {"__dict__": x}, st.lists(st.tuples(SCALARS, children).map(list), max_size=3)),
        st.builds(lambda x, s: {"__objects__": x, "shape": s}, st.lists(children, max_size=3),
                  st.lists(st.integers(-1, 3), max_size=2)),
        st.builds(lambda x: {"__float__": x}, st.sampled_from(["nan", "inf", "__import__('os')", "1"])),
        st.builds(lambda x: {"__tensor__": x}, children),
        st.builds(lambda c, i: {"__frame__": c, "index": i}, st.lists(st.tuples(SCALARS, children).map(list),
                                                                     max_size=2), children),
        st.dictionaries(st.text(max_size=10), children, max_size=3),
    )


SKELETONS = st.recursive(SCALARS, _skeletons, max_leaves=12)


@settings(max_examples=300, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
@given(skeleton=SKELETONS)
def test_no_file_content_calls_outside_the_registry(tmp_path, skeleton):
    outcome, events, foreign = watched_load(write(tmp_path, skeleton))
    assert events == [], events
    assert foreign == [], foreign
    if isinstance(outcome, Exception):
        assert isinstance(outcome, phaselens.PhaseLensError), repr(outcome)
        return
    for obj in _walk(outcome):
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            assert type(obj).__qualname__ in registry.TYPES


def test_the_monitors_see_a_planted_call(tmp_path, monkeypatch):
    """The property's monitors can fail: a loader that resolved names as the old one did is caught by both."""
    import importlib

    def old_resolve(name):
        module, _, qual = name.partition(":")
        return getattr(importlib.import_module(module), qual)

    monkeypatch.setattr(storage, "resolve", old_resolve)
    monkeypatch.setattr(storage, "check_fields", lambda cls, values: None)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    path = write(tmp_path, {"__dataclass__": "phaselens.storage.writing:atomic_write_text",
                            "fields": {"path": str(victim), "text": "owned"}})
    _, events, foreign = watched_load(path)
    assert victim.read_text() == "owned"  # what the report's file did
    assert any(e == "open" for e, _ in events) and any("atomic_write_text" in f for f in foreign)
