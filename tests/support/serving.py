"""A real ``transformers serve`` on 127.0.0.1 for the served-model tests and benchmark (nothing downloaded).

:func:`write_tiny_checkpoint` saves a tiny random DeepSeek-V4 (built from a config) with a byte-level BPE
tokenizer trained on the spot (``tokenizers``); :class:`Server` starts ``transformers serve`` on it on a free
port (offline), waits for ``/health``, and kills the whole process group on ``stop``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVE_TIMEOUT = 180.0  # seconds to wait for the server (imports and model load; slower on a busy machine)


def write_tiny_checkpoint(path: Path, *, seed: int = 3) -> Path:
    """A tiny DeepSeek-V4 (4 layers: sliding, CSA 4, HCA 16, CSA 4) and its tokenizer in ``path``; the model's
    vocabulary is the tokenizer's (no id beyond it can be predicted)."""
    from transformers import PreTrainedTokenizerFast

    from phaselens.tasks import train_toy_tokenizer
    from tests.support.deepseek import tiny_v4_model

    tok = train_toy_tokenizer()
    model = tiny_v4_model(seed=seed, vocab_size=tok.get_vocab_size())
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``transformers serve CHECKPOINT`` on 127.0.0.1 (CPU, float32, offline) in its own process group."""

    def __init__(self, checkpoint: Path, *, port: int | None = None, log: Path | None = None) -> None:
        self.checkpoint, self.port = Path(checkpoint), port or free_port()
        self.log = log or self.checkpoint.parent / f"serve-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Server:
        exe = Path(sys.executable).with_name("transformers")
        cmd = [str(exe), "serve", str(self.checkpoint), "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + SERVE_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"transformers serve did not come up in {SERVE_TIMEOUT:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """Kill the server's process group (it spawns workers) and wait for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
