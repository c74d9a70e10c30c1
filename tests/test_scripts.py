"""Every tool, experiment, benchmark and GPU / reference check imports as a module of this repository, and none
edits ``sys.path``: each runs from the repository root as ``python -m tools.gen_zoo_docs``,
``python -m experiments.stats_simulations``, ``python -m benchmarks.bench_model``, ``python -m tests.gpu.session``
or ``python -m tests.reference.v4_parity`` (a module moved inside phaselens or tests/ must not leave one behind:
the reference-parity checks, whose test is skipped without DeepSeek's code, once did)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import ROOT

# Folders of runnable modules: each is a package (an __init__.py in it and in every subfolder).
FOLDERS = ("tools", "experiments", "benchmarks", "tests/gpu", "tests/reference")
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for folder in FOLDERS
    for p in (ROOT / folder).rglob("*.py")
    if p.name != "__init__.py"
)
# Any edit of the import path: insert/append/extend, a slice assignment, += or a new list.
SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)\b|sys\.path(\[[^\]]*\])?\s*\+?=(?!=)")
# Files that still edit sys.path, each with its reason. Only code that a test runs in a child process.
ALLOWED = {
    # launched as `python tests/support/family_worker.py` and under torchrun by tests/train/family/test_train.py
    "tests/support/family_worker.py",
}


def test_there_are_modules_to_check():
    for name in ("tools.gen_zoo_docs", "tools.train_zoo", "experiments.stats_simulations", "benchmarks.bench_family",
                 "tests.gpu.session", "tests.reference.v4_parity", "tests.reference.v4.loader"):
        assert name in MODULES, name
    assert len(MODULES) > 35
    assert not (ROOT / "scripts").exists()


def test_every_folder_of_modules_is_a_package():
    """``python -m folder.module`` and ``import folder.module`` need no path edits from the repository root."""
    folders = {p.parent for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    missing = sorted(str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").is_file())
    assert missing == []


def test_no_test_file_in_the_module_folders():
    """The GPU and reference checks fail or need what CI lacks: pytest must not collect them as tests."""
    found = [str(p.relative_to(ROOT)) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
             if p.name.startswith("test_") or p.stem.endswith("_test")]
    assert found == []


def test_every_module_imports():
    code = ("import importlib, sys, traceback\nsys.argv = ['check']\nbad = []\n"
            f"for m in {MODULES!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except BaseException as err:\n        bad.append(f'{m}: {type(err).__name__}: {err}')\n"
            "print('\\n'.join(bad))\nsys.exit(1 if bad else 0)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]


def _repository_files() -> list[str]:
    """Tracked files and new files git does not ignore (so .venv, caches and runs/ are not read)."""
    res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return sorted(set(filter(None, res.stdout.split("\0"))))


def test_nothing_edits_sys_path():
    this = str((ROOT / __file__).resolve().relative_to(ROOT))
    found = []
    for name in _repository_files():
        path = ROOT / name
        if name == this or name in ALLOWED or not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in SYS_PATH_EDIT.finditer(text)]
    assert found == [], "run it as a module from the repository root instead:\n" + "\n".join(found)


def test_every_phony_make_target_has_a_rule():
    text = (ROOT / "Makefile").read_text()
    (phony,) = re.findall(r"^\.PHONY:(.*)$", text, flags=re.M)
    rules = set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))
    assert [t for t in phony.split() if t not in rules] == []
