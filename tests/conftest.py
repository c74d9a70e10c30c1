"""Shared fixtures: tiny models built in-test (never downloaded)."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from phaselens.models import CompressorSpec
from tests.support.models import LAYOUTS, make_model, task_model, tiny_task  # noqa: F401  (re-exported)

# Under pytest-xdist (`make test` runs one worker per core) each worker uses one thread.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# No per-example time limit: speed is measured in benchmarks/, and a loaded 2-core machine would make
# hypothesis' default 200 ms deadline fail tests whose results are right. No example database either: its
# default is a .hypothesis/ folder in the directory pytest runs from (the checkout), and tests write only under
# temporary folders (tests/test_clean_checkout.py); the fuzz tests are derandomized, so nothing is lost.
settings.register_profile("phaselens", deadline=None, database=None)
settings.load_profile("phaselens")
# hypothesis also caches what it reads of the source (.hypothesis/constants) in the working directory: that goes to
# the system's temporary folder (a HYPOTHESIS_STORAGE_DIRECTORY of your own is kept)
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      str(Path(tempfile.gettempdir()) / f"phaselens-hypothesis-{getpass.getuser()}"))
set_hypothesis_home_dir(os.environ["HYPOTHESIS_STORAGE_DIRECTORY"])



@pytest.fixture(params=list(LAYOUTS), ids=list(LAYOUTS))
def layout(request) -> CompressorSpec:
    return LAYOUTS[request.param]


# Tests whose outcome rests on float kernels: `make test-portable` (tools/portable_tests.py) runs them under every
# CPU capability the machine can emulate. Marked by where they live, so a new test there is covered too.
NUMERICS = ("tests/models/", "tests/analyses/", "tests/train/", "tests/contract/", "tests/core/", "tests/integrations/",
            "tests/test_pinned_numbers.py", "tests/test_doc_knockouts.py", "tests/test_docs.py")


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath) + os.sep
    for item in items:
        rel = str(item.path).removeprefix(root).replace(os.sep, "/")
        if rel.startswith(NUMERICS):
            item.add_marker(pytest.mark.numerics)


def pytest_report_header(config):
    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"
