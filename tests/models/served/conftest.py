"""One real ``transformers serve`` for the session: a tiny DeepSeek-V4 and its tokenizer, built and saved here,
served on a free port of 127.0.0.1 (offline) and killed when the session ends."""

from __future__ import annotations

import pytest

from tests.support.serving import Server, write_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("served") / "tiny-v4")


@pytest.fixture(scope="session")
def server(checkpoint):
    srv = Server(checkpoint)
    try:
        yield srv.start()
    finally:
        srv.stop()
