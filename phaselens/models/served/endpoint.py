"""The HTTP side of a served model: one ``httpx`` client per endpoint, with a deadline, retries and clear errors.

Every request has one total deadline, ``timeout=`` seconds, that covers every attempt, the waits between them
(``Retry-After`` included) and the reply's body however slowly it arrives. The requests run on an
``httpx.AsyncClient`` on one event loop in a background thread (:func:`io_loop`), under ``asyncio.timeout``:
a server that trickles its headers or body a byte at a time, or goes silent mid-reply, is cut at the
deadline (httpx's own timeouts apply to each read, which a trickle never trips). Callers stay synchronous,
from any thread (a notebook's own event loop is never in the way).

Retried, with exponential backoff and jitter (honouring ``Retry-After``): dropped or refused connections,
connect timeouts, and the statuses a busy or restarting server sends (429, 502, 503, 504). A wait that would
end past the deadline is not started. Every other error status is the request's fault and is raised at once
with the server's own message. When the retries or the deadline are spent the error is a
:class:`~phaselens.errors.ServerError` that names the server's address.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import random
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from phaselens.errors import InputError, ServerError

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
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        out["prompt_tokens_per_s"] = round(self.prompt_tokens / self.seconds, 1) if self.seconds > 0 else None
        return out


class InFlight:
    """The requests of one batch, cancelled together when the batch fails or is interrupted: the others stop
    at once (their connections closed) instead of running on to their deadline for nothing."""

    def __init__(self) -> None:
        self._futures: set[Any] = set()
        self._lock = threading.Lock()
        self.cancelled = False

    def add(self, future: Any) -> None:
        with self._lock:
            self._futures.add(future)
            if self.cancelled:
                future.cancel()

    def discard(self, future: Any) -> None:
        with self._lock:
            self._futures.discard(future)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            for future in self._futures:
                future.cancel()


class Endpoint:
    """One server: its address, an ``httpx.AsyncClient`` (pooled) and the deadline and retry policy.

    Args:
        url: ``http://HOST:PORT`` or ``http://HOST:PORT/v1``.
        timeout: seconds a request may take in all: every attempt, the waits between them and the reply's
            body (a 128K-token prefill behind a queue can take minutes).
        connect_timeout: seconds to open a connection (a host that never answers is retried after this).
        retries: attempts after the first one on a dropped connection, a connect timeout or 429/502/503/504.
        backoff: the first wait in seconds; it doubles per attempt up to ``max_backoff`` (with jitter).
        connections: the connection pool's size (at least the requests in flight).
        api_key: sent as a bearer token when the server wants one.
    """

    def __init__(self, url: str, *, timeout: float = 3600.0, connect_timeout: float = 10.0, retries: int = 6,
                 backoff: float = 1.0, max_backoff: float = 60.0, connections: int = 16,
                 api_key: str | None = None) -> None:
        import httpx

        self.api, self.root = normalize_url(url)
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self.retries, self.backoff, self.max_backoff = int(retries), float(backoff), float(max_backoff)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.AsyncClient(
            # no per-read timeout: the request's deadline (asyncio.timeout) bounds it all, a trickle included
            timeout=httpx.Timeout(None, connect=min(self.connect_timeout, self.timeout)),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            headers=headers,
        )
        self.traffic = Traffic()
        self._lock = threading.Lock()
        # an endpoint dropped unclosed (a notebook cell re-run) closes its pooled connections when collected
        self._finalizer = weakref.finalize(self, _close_later, self.client)
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        return f"Endpoint({self.api})"

    def close(self) -> None:
        """Close the pooled connections now (and wait for it); the endpoint sends nothing afterwards."""
        self._finalizer.detach()
        if not self.client.is_closed:
            asyncio.run_coroutine_threadsafe(self.client.aclose(), io_loop()).result(timeout=30)

    # ---- requests -----------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, root: bool = False,
                retries: int | None = None, group: InFlight | None = None) -> Any:
        """The final ``httpx.Response`` of ``method path`` (retried as the module docstring says), its body
        read in full, within ``timeout`` seconds of the call.

        Raises :class:`ServerError` when no attempt got an answer, every answer was a retryable status, or the
        deadline passed. ``group`` collects the request with others sent for one batch, so that they can be
        cancelled together (:class:`InFlight`).
        """
        url = (self.root if root else self.api) + path
        req = self.client.build_request(method, url, json=body)  # encoded here, not on the shared loop
        attempts = 1 + (self.retries if retries is None else int(retries))
        future = asyncio.run_coroutine_threadsafe(self._request(req, method, path, attempts), io_loop())
        if group is not None:
            group.add(future)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupt (or any error here) stops the request on the loop too
            raise
        finally:
            if group is not None:
                group.discard(future)

    async def _request(self, req: Any, method: str, path: str, attempts: int) -> Any:
        import httpx

        start = time.monotonic()
        state = {"why": "", "doing": "waiting for the reply", "attempt": 0}
        resp = None
        try:
            async with asyncio.timeout(self.timeout):
                for attempt in range(attempts):
                    state["attempt"] = attempt + 1
                    if attempt:
                        with self._lock:
                            self.traffic.retries += 1
                    try:
                        state["doing"], resp = "waiting for the reply", None
                        resp = await self.client.send(req, stream=True)
                        state["doing"] = "reading the reply's body"
                        try:
                            await resp.aread()
                        finally:
                            await resp.aclose()
                    except httpx.TransportError as err:  # refused, dropped, timed out, reset mid-answer
                        state["why"] = _transport_reason(err)
                        wait = self._wait(attempt, None)
                    else:
                        if resp.status_code not in RETRY_STATUS:
                            return resp
                        state["why"] = f"HTTP {resp.status_code} {_detail(resp)[:200]}".rstrip()
                        wait = self._wait(attempt, resp.headers.get("retry-after"))
                    if attempt + 1 < attempts:
                        left = self.timeout - (time.monotonic() - start)
                        if wait >= left:
                            raise ServerError(self._late(method, path, state, start, f"a retry was due in {wait:.1f} s "
                                                         f"(Retry-After or backoff), past the deadline"))
                        state["doing"] = f"waiting {wait:.1f} s to retry"
                        await asyncio.sleep(wait)
        except TimeoutError:
            if state["doing"].startswith("reading") and resp is not None:
                state["doing"] += f" ({resp.num_bytes_downloaded:,} bytes had arrived)"
            raise ServerError(self._late(method, path, state, start, state["doing"])) from None
        took = time.monotonic() - start
        raise ServerError(
            f"the server at {self.api} did not answer {method} {path} ({state['why']}) in {attempts} attempt(s) over "
            f"{took:.0f} s; check that it is running (and restart it). With journal=, rerunning resumes "
            "where this run stopped."
        )

    def _late(self, method: str, path: str, state: dict[str, Any], start: float, doing: str) -> str:
        before = f"; the last answer: {state['why']}" if state["why"] else ""
        return (f"the server at {self.api} did not answer {method} {path} within timeout={self.timeout:g} s, the "
                f"deadline of the whole request (every attempt, the waits between them and the reply's body): "
                f"{doing} ({time.monotonic() - start:.1f} s in, attempt {state['attempt']}{before}). A slow or busy "
                "server needs a larger timeout= (a 128K prefill behind a queue takes minutes); with journal=, "
                "rerunning resumes where this run stopped.")

    def json(self, method: str, path: str, body: Any = None, *, root: bool = False,
             retries: int | None = None, what: str = "", group: InFlight | None = None) -> Any:
        """The JSON answer of a request that must succeed; an error status raises :class:`ServerError` with the
        server's message."""
        resp = self.request(method, path, body, root=root, retries=retries, group=group)
        if resp.status_code >= 400:
            raise ServerError(f"the server at {self.api} refused {what or method + ' ' + path}: HTTP "
                              f"{resp.status_code} {_detail(resp)[:500]}")
        return self.decoded(resp, f"{method} {path}")

    def decoded(self, resp: Any, asked: str) -> Any:
        """The JSON body of ``resp``; a body that is not JSON is a :class:`ServerError` naming what was ``asked``."""
        try:
            return resp.json()
        except ValueError:
            raise ServerError(f"the server at {self.api} answered {asked} with something that is not JSON: "
                              f"{resp.text[:200]!r}") from None

    def _wait(self, attempt: int, retry_after: str | None) -> float:
        """Seconds before the next attempt: ``Retry-After`` (seconds or an HTTP date), else the backoff."""
        if retry_after:
            seconds = _retry_after(retry_after)
            if seconds is not None:
                return min(self.max_backoff, seconds)
        return min(self.max_backoff, self.backoff * 2.0 ** min(attempt, 32)) * (0.5 + 0.5 * random.random())

    def count(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """Count one answered request."""
        with self._lock:
            t = self.traffic
            t.requests += 1
            t.prompt_tokens += int(prompt_tokens)
            if cached_tokens is not None:
                t.cached_tokens += int(cached_tokens)
                t.cached_reported += 1


def _retry_after(value: str) -> float | None:
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if seconds == seconds else None  # NaN: no usable answer


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_LOOP_LOCK = threading.Lock()


def io_loop() -> asyncio.AbstractEventLoop:
    """The event loop every endpoint's requests run on: one per process, on a daemon thread (started on first
    use, and again in a forked child, which inherits no threads)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid() or _LOOP[1].is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="phaselens-served-io", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


def _close_later(client: Any) -> None:
    """Schedule ``client.aclose()`` on the I/O loop without waiting: a collected endpoint's finalizer may run on
    any thread, the loop's own included, where waiting would deadlock."""
    loop = _LOOP[1] if _LOOP is not None and _LOOP[0] == os.getpid() else None
    if loop is None or loop.is_closed() or client.is_closed:
        return  # no loop in this process: the client never opened a connection here

    def start() -> None:
        task = loop.create_task(client.aclose())
        _CLOSING.add(task)  # the loop holds tasks weakly: keep it until it is done
        task.add_done_callback(_CLOSING.discard)

    loop.call_soon_threadsafe(start)


_CLOSING: set[asyncio.Task] = set()


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
