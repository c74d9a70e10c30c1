"""Every script and benchmark still imports: a module moved inside phaselens or tests/ must not leave a script
behind (the reference-parity scripts, whose test is skipped without DeepSeek's code, once did)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import ROOT

MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for folder in ("scripts", "benchmarks")
    for p in (ROOT / folder).rglob("*.py")
    if p.name != "__init__.py"
)


def test_there_are_scripts_to_check():
    assert "scripts.v4_reference.loader" in MODULES and "benchmarks.bench_family" in MODULES and len(MODULES) > 30


def test_every_script_and_benchmark_imports():
    code = ("import importlib, sys, traceback\nsys.argv = ['check']\nbad = []\n"
            f"for m in {MODULES!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except BaseException as err:\n        bad.append(f'{m}: {type(err).__name__}: {err}')\n"
            "print('\\n'.join(bad))\nsys.exit(1 if bad else 0)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
