"""Tests write only under temporary folders, also when pytest runs from the checkout's root (issue 44).

Run there, the suite left ``.hypothesis/`` (hypothesis' example database defaults to the working directory) and
``map.html`` (an example's ``fig.write_html("map.html")``) behind. Now the hypothesis profile has no database
(tests/conftest.py) and every doctest pytest collects runs from its own temporary folder (conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.support.paths import ROOT


def _root_entries() -> set[str]:
    """The checkout root's entries, and every file of a ``.hypothesis`` folder left there by an older run (with its
    modification time): a run that writes into one that exists is caught too."""
    cache = ROOT / ".hypothesis"
    written = {f"{p}@{p.stat().st_mtime_ns}" for p in cache.rglob("*") if p.is_file()} if cache.is_dir() else set()
    return set(os.listdir(ROOT)) | written


def _pytest(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    # the child's own conftest must keep hypothesis out of the checkout: nothing of this process's is inherited
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0",
                           "-q", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_a_run_from_the_root_adds_nothing_to_it():
    """A hypothesis test, a docs page run as doctests by the suite, and the same page collected by pytest."""
    before = _root_entries()
    res = _pytest("tests/test_fuzz_inputs.py::test_tasks_and_batches_refuse_bad_fields_and_indices",
                  "tests/test_docs.py::test_page_examples_run[concepts.md]", "--doctest-glob=*.md", "docs/concepts.md")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "3 passed" in res.stdout, res.stdout[-1000:]  # the page collected by pytest is one item
    assert _root_entries() - before == set(), "the run wrote into the checkout's root"


def test_a_doctest_that_writes_a_file_writes_it_in_its_temporary_folder(tmp_path):
    """The root conftest's fixture, loaded as pytest loads it for the checkout's pages: a doctest that writes
    map.html from the root leaves it in pytest's temporary folder."""
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        >>> import os
        >>> with open("map.html", "w") as f:
        ...     _ = f.write("<html></html>")
        >>> os.path.isfile("map.html")
        True
        """))
    before = _root_entries()
    res = _pytest("-p", "conftest", f"--basetemp={tmp_path / 'pytest'}", "--doctest-glob=*.md", str(page),
                  f"--rootdir={tmp_path}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert _root_entries() - before == set() and not (ROOT / "map.html").exists()
    assert list((tmp_path / "pytest").rglob("map.html")), "the doctest did not run in its temporary folder"
