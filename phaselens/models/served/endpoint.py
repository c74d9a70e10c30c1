"""The HTTP side of a served model: one ``httpx`` client per endpoint, with timeouts, retries and clear errors.

Retried, with exponential backoff and jitter (honouring ``Retry-After``): dropped or refused connections,
timeouts, and the statuses a busy or restarting server sends (429, 502, 503, 504). Every other error status is
the request's fault and is raised at once with the server's own message. When the retries are spent the
error is a :class:`~phaselens.core.errors.ServerError` that names the server's address.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from phaselens.core.errors import InputError, ServerError

RETRY_STATUS = frozenset({429, 502, 503, 504})


def normalize_url(url: str) -> tuple[str, str]:
    """``(api, root)``: the OpenAI-style base ending in ``/v1`` and the server's root (native endpoints such as
    SGLang's ``/generate`` and vLLM's ``/tokenize`` live there)."""
    text = str(url).strip().rstrip("/")
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1]) == 0:
        raise InputError(f"{url!r} is not a server address; pass one like 'http://127.0.0.1:8000/v1'.")
    api = text if text.endswith("/v1") else text + "/v1"
    return api, api[: -len("/v1")]


@dataclass
class Traffic:
    """What the endpoint has sent and received (for progress, metadata and the prefix-cache measurement)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens the server reported served from its prefix cache (vLLM, SGLang)
    cached_reported: int = 0  # requests whose response said how many tokens were cached
    retries: int = 0
    seconds: float = 0.0  # wall time spent inside answer_queries calls

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("requests", "prompt_tokens", "cached_tokens", "cached_reported",
                                             "retries")}
        out["seconds"] = round(self.seconds, 3)
        out["prompt_tokens_per_s"] = round(self.prompt_tokens / self.seconds, 1) if self.seconds > 0 else None
        return out


class Endpoint:
    """One server: its address, an ``httpx.Client`` (thread-safe, pooled) and the retry policy.

    Args:
        url: ``http://HOST:PORT`` or ``http://HOST:PORT/v1``.
        timeout: seconds a request may take (a 128K-token prefill behind a queue can take minutes).
        connect_timeout: seconds to open a connection.
        retries: attempts after the first one on a dropped connection, a timeout or 429/502/503/504.
        backoff: the first wait in seconds; it doubles per attempt up to ``max_backoff`` (with jitter).
        connections: the connection pool's size (at least the requests in flight).
        api_key: sent as a bearer token when the server wants one.
    """

    def __init__(self, url: str, *, timeout: float = 3600.0, connect_timeout: float = 10.0, retries: int = 6,
                 backoff: float = 1.0, max_backoff: float = 60.0, connections: int = 16,
                 api_key: str | None = None) -> None:
        import httpx

        self.api, self.root = normalize_url(url)
        self.retries, self.backoff, self.max_backoff = int(retries), float(backoff), float(max_backoff)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            headers=headers,
        )
        self.traffic = Traffic()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Endpoint({self.api})"

    def close(self) -> None:
        self.client.close()

    # ---- requests -----------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, root: bool = False,
                retries: int | None = None) -> Any:
        """The final ``httpx.Response`` of ``method path`` (retried as the module docstring says).

        Raises :class:`ServerError` when no attempt got an answer, or every answer was a retryable status.
        """
        import httpx

        url = (self.root if root else self.api) + path
        attempts = 1 + (self.retries if retries is None else int(retries))
        start = time.monotonic()
        why = ""
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.traffic.retries += 1
            try:
                resp = self.client.request(method, url, json=body)
            except httpx.TransportError as err:  # refused, dropped, timed out, reset mid-answer
                why = _transport_reason(err)
                wait = self._wait(attempt, None)
            else:
                if resp.status_code not in RETRY_STATUS:
                    return resp
                why = f"HTTP {resp.status_code} {_detail(resp)[:200]}".rstrip()
                wait = self._wait(attempt, resp.headers.get("retry-after"))
            if attempt + 1 < attempts:
                time.sleep(wait)
        took = time.monotonic() - start
        raise ServerError(
            f"the server at {self.api} did not answer {method} {path} ({why}) in {attempts} attempt(s) over "
            f"{took:.0f} s; check that it is running (and restart it). With checkpoint=, rerunning resumes "
            "where this run stopped."
        )

    def json(self, method: str, path: str, body: Any = None, *, root: bool = False,
             retries: int | None = None, what: str = "") -> Any:
        """The JSON answer of a request that must succeed; an error status raises :class:`ServerError` with the
        server's message."""
        resp = self.request(method, path, body, root=root, retries=retries)
        if resp.status_code >= 400:
            raise ServerError(f"the server at {self.api} refused {what or method + ' ' + path}: HTTP "
                              f"{resp.status_code} {_detail(resp)[:500]}")
        try:
            return resp.json()
        except ValueError:
            raise ServerError(f"the server at {self.api} answered {method} {path} with something that is not JSON: "
                              f"{resp.text[:200]!r}") from None

    def _wait(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(self.max_backoff, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + 0.5 * random.random())

    def count(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """Count one answered request."""
        with self._lock:
            t = self.traffic
            t.requests += 1
            t.prompt_tokens += int(prompt_tokens)
            if cached_tokens is not None:
                t.cached_tokens += int(cached_tokens)
                t.cached_reported += 1


def _transport_reason(err: Exception) -> str:
    import httpx

    kind = {httpx.ConnectError: "connection refused or unreachable", httpx.ConnectTimeout: "connect timed out",
            httpx.ReadTimeout: "no answer within the timeout", httpx.RemoteProtocolError: "connection dropped",
            httpx.ReadError: "connection dropped", httpx.WriteError: "connection dropped"}
    for cls, text in kind.items():
        if isinstance(err, cls):
            return text
    return type(err).__name__


def _detail(resp: Any) -> str:
    """The server's error message (FastAPI's ``detail``, OpenAI's ``error.message``), else the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("detail", "error", "message"):
            if body.get(key):
                return str(body[key])
    return str(body)
