"""A real HTTP server on 127.0.0.1 that misbehaves on purpose (``http.server`` in a thread; real sockets, real
HTTP/1.1): it serves ``/v1/models``, OpenAI ``/v1/completions`` (text prompts as ``transformers serve`` takes
them, token-id prompts as vLLM answers them) and SGLang's ``/generate``, answering every prompt with one fixed
token, and lets a test change what it sends:

* ``mutate``: a function of the well-formed JSON reply that returns the reply to send (a malformed one);
* ``fault``: a function ``(handler, path) -> bool`` that writes raw HTTP itself (a 503 with ``Retry-After``,
  headers or a body trickled a byte at a time) and returns ``True`` when it handled the request.

The happy paths are tested against a real ``transformers serve`` (``test_served.py``); this server exists to
plant faults that a well-behaved server never shows.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from phaselens.models.served.vocabulary import Vocabulary


class FaultyServer:
    """Start with ``with FaultyServer(tokenizer) as srv:``; ``srv.url`` is its ``/v1`` address."""

    def __init__(self, tokenizer: Any, *, token: int, max_model_len: int | None = None) -> None:
        self.vocab, self.token, self.max_model_len = Vocabulary(tokenizer), int(token), max_model_len
        self.mutate: Callable[[Any], Any] | None = None
        self.fault: Callable[[BaseHTTPRequestHandler, str], bool] | None = None
        self.requests: list[tuple[float, str]] = []  # (monotonic time, path) of every request
        self.hangups: list[float] = []  # when a trickled reply's client hung up (monotonic time)
        self.stopping = threading.Event()
        self.httpd = _Quiet(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FaultyServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- well-formed replies ------------------------------------------------------------------------
    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else self.vocab.encode(prompt, special=True)
        choice: dict[str, Any] = {"index": 0, "text": self.vocab.decode([self.token]), "finish_reason": "length",
                                  "logprobs": None}
        if body.get("return_token_ids"):  # vLLM
            choice.update(token_ids=[self.token], prompt_token_ids=ids, logprobs={
                "text_offset": [0], "token_logprobs": [-0.5], "tokens": [f"token_id:{self.token}"],
                "top_logprobs": [{f"token_id:{self.token}": -0.5, "token_id:3": -1.5}]})
        return {"id": "cmpl-0", "object": "text_completion", "model": "faulty", "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = body["input_ids"]
        return {"text": self.vocab.decode([self.token]), "output_ids": [self.token], "meta_info": {
            "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, self.token, None]],
            "output_token_ids_logprobs": [[[-0.5, self.token, None], [-1.5, 3, None]]]}}


class _Quiet(ThreadingHTTPServer):
    """A client hanging up is part of the tests (cancelled batches, deadlines): not worth a traceback on stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(server: FaultyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            server.requests.append((time.monotonic(), self.path))
            if server.fault is not None and server.fault(self, self.path):
                return
            card = {"id": "faulty", "object": "model", "owned_by": "phaselens-tests"}
            if server.max_model_len is not None:
                card["max_model_len"] = server.max_model_len
            self.send_json({"object": "list", "data": [card]})

        def do_POST(self) -> None:  # noqa: N802
            server.requests.append((time.monotonic(), self.path))
            size = int(self.headers.get("content-length", 0))
            raw = self.rfile.read(size)
            if len(raw) < size:  # the client hung up mid-request (a failed batch cancels the rest): nobody to answer
                self.close_connection = True
                return
            body = json.loads(raw or b"null")
            if server.fault is not None and server.fault(self, self.path):
                return
            if self.path == "/v1/completions":
                reply = server.completion(body)
            elif self.path == "/generate":
                reply = server.generate(body)
            else:
                self.send_json({"detail": "Not Found"}, 404)
                return
            self.send_json(server.mutate(reply) if server.mutate is not None else reply)

        def send_json(self, value: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

    return Handler


# ---- raw faults ------------------------------------------------------------------------------------------------
def busy(retry_after: str, paths: tuple[str, ...] = ("/v1/completions",)) -> Callable[..., bool]:
    """Answer ``paths`` with HTTP 503 and ``Retry-After: retry_after``, every time."""

    def fault(handler: Any, path: str) -> bool:
        if path not in paths:
            return False
        handler.send_json({"detail": "busy"}, 503, {"Retry-After": retry_after})
        return True

    return fault


def trickle(server: FaultyServer, *, where: str = "body", every: float = 0.2, n: int = 200,
            paths: tuple[str, ...] = ("/v1/completions",)) -> Callable[..., bool]:
    """Send ``paths``' answer one byte every ``every`` seconds: the body (``where="body"``, after complete
    headers announcing ``n`` bytes) or the headers themselves (``where="headers"``). ``n`` bytes take
    ``n * every`` seconds: far longer than the deadlines the tests set."""

    def fault(handler: Any, path: str) -> bool:
        if path not in paths:
            return False
        handler.close_connection = True
        try:
            if where == "body":
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(n))
                handler.end_headers()
                handler.wfile.flush()
                payload = b" " * n
            else:
                handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
                payload = b"X-Slow: " + b"a" * n + b"\r\n"
            for i in range(len(payload)):
                if server.stopping.is_set():
                    return True
                handler.wfile.write(payload[i : i + 1])
                handler.wfile.flush()
                time.sleep(every)
        except OSError:  # the client hung up: what a deadline (or a cancelled batch) does
            server.hangups.append(time.monotonic())
        return True

    return fault
