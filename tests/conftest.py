"""Shared fixtures: tiny models built in-test (never downloaded)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from phaselens.models import CompressorSpec
from tests.support.models import LAYOUTS, make_model, task_model, tiny_task  # noqa: F401  (re-exported)

# Under pytest-xdist (`make test` runs one worker per core) each worker uses one thread.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# No per-example time limit: speed is measured in benchmarks/, and a loaded 2-core machine would make
# hypothesis' default 200 ms deadline fail tests whose results are right.
settings.register_profile("phaselens", deadline=None)
settings.load_profile("phaselens")


@pytest.fixture(params=list(LAYOUTS), ids=list(LAYOUTS))
def layout(request) -> CompressorSpec:
    return LAYOUTS[request.param]


# Tests whose outcome rests on float kernels: `make test-portable` (tools/portable_tests.py) runs them under every
# CPU capability the machine can emulate. Marked by where they live, so a new test there is covered too.
NUMERICS = ("tests/models/", "tests/analyses/", "tests/train/", "tests/contract/", "tests/core/",
            "tests/test_pinned_numbers.py", "tests/test_doc_knockouts.py", "tests/test_docs.py")


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath) + os.sep
    for item in items:
        rel = str(item.path).removeprefix(root).replace(os.sep, "/")
        if rel.startswith(NUMERICS):
            item.add_marker(pytest.mark.numerics)


def pytest_report_header(config):
    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"
