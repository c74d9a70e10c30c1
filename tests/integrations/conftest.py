"""lm-evaluation-harness tests: offline, and every dataset cache under the session's tmp folder (lm-eval reads local
JSONL through ``datasets``, which caches what it reads)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def offline_datasets(tmp_path_factory):
    import datasets

    cache = tmp_path_factory.mktemp("hf-datasets")
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update({"HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    previous = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = cache
    yield cache
    datasets.config.HF_DATASETS_CACHE = previous
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
