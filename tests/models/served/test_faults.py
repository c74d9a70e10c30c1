"""Faults a well-behaved server never shows, planted on a real HTTP server on 127.0.0.1 (``faulty.py``):
malformed replies are a ``ServerError`` naming the field and the dialect (never a score), every request ends
at its ``timeout=`` deadline whatever the server does (``Retry-After``, a trickled body or headers), and the
loader's options are checked before anything is sent."""

from __future__ import annotations

import copy
import math
import time
from email.utils import formatdate

import pytest

import phaselens
from phaselens.errors import InputError, ServerError
from phaselens.models.served.endpoint import Endpoint
from phaselens.models.served.protocols import Dialect
from phaselens.models.served.replies import LABELS
from phaselens.models.served.vocabulary import Vocabulary
from phaselens.tasks import Needle, train_toy_tokenizer
from tests.models.served.faulty import FaultyServer, busy, trickle
from tests.support.serving import free_port

DEADLINE = 1.5  # seconds: the deadline the timing tests set
SLACK = 1.0  # seconds a loaded 2-core machine may add to it (the faults would run 20 s and more without it)


@pytest.fixture(scope="module")
def tok():
    return train_toy_tokenizer()


@pytest.fixture(scope="module")
def token(tok):
    (cat,) = Vocabulary(tok).encode(" cat")
    return cat


@pytest.fixture
def srv(tok, token):
    with FaultyServer(tok, token=token) as s:
        yield s


def load(srv, tok, protocol, **kw):
    return phaselens.load(srv.url, tokenizer=tok, stride=4, protocol=protocol, progress=False, retries=0, **kw)


def evaluate(model, tok):
    task = Needle(tok, n_records=8, n_demos=1, modulus=8)
    return phaselens.evaluate(model, task, n_per_residue=1, progress=False, n_permutations=20, n_bootstrap=0)


# ---- malformed replies ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["vllm", "sglang", "openai-ids", "openai-text"])
def test_the_faulty_server_is_read_right_when_it_is_well_formed(srv, tok, token, protocol):
    """The control: unmutated, every dialect reads the server's token for every item (so the refusals below
    come from the planted faults, not from the server)."""
    m = load(srv, tok, protocol)
    ev = evaluate(m, tok)
    assert (ev.items["predicted"] == token).all() and len(ev.items) == 8
    if protocol in ("vllm", "sglang"):  # log-probabilities reported: the greedy token's is -0.5
        assert ev.items["predicted"].eq(token).all()
        assert m.endpoint.traffic.requests >= 8


def _set(path, value):
    """A mutation that sets ``reply[path...]`` (``...`` deletes it)."""

    def mutate(reply):
        reply = copy.deepcopy(reply)
        *head, last = path
        node = reply
        for key in head:
            node = node[key]
        if value is ...:
            del node[last]
        else:
            node[last] = value
        return reply

    return mutate


MALFORMED = [  # (dialect, mutation, what the message names)
    ("vllm", _set(["choices"], []), "choices is an empty list"),
    ("openai-text", _set(["choices"], []), "choices is an empty list"),
    ("openai-text", _set(["choices", 0, "text"], None), "choices[0].text is null"),
    ("openai-ids", _set(["choices", 0, "text"], ...), "choices[0].text is missing"),
    ("vllm", _set(["choices", 0, "token_ids"], []), "choices[0].token_ids is an empty list"),
    ("vllm", _set(["choices", 0, "token_ids"], ["7"]), "choices[0].token_ids[0] is str '7', not an integer"),
    ("vllm", _set(["choices", 0], "abc"), "choices[0] is str 'abc', not an object"),
    ("openai-text", _set(["usage"], "n/a"), "usage is str 'n/a', not an object"),
    ("openai-text", _set(["usage", "prompt_tokens"], "many"), "usage.prompt_tokens is str 'many', not an integer"),
    ("openai-text", _set(["usage", "prompt_tokens"], 12.5), "usage.prompt_tokens is float 12.5, not an integer"),
    ("openai-text", _set(["usage"], ...), "usage is missing"),
    ("vllm", _set(["usage", "prompt_tokens"], -3), "usage.prompt_tokens is -3, below 0"),
    ("vllm", _set(["choices", 0, "logprobs", "top_logprobs"], [{"cat": -0.5}]), "not 'token_id:N'"),
    ("vllm", _set(["choices", 0, "logprobs", "token_logprobs"], [3.0]), "above 0"),
    ("vllm", _set(["choices", 0, "prompt_token_ids"], "1 2 3"), "choices[0].prompt_token_ids is str"),
    ("sglang", _set(["output_ids"], []), "output_ids is an empty list"),
    ("sglang", _set(["meta_info"], ...), "meta_info is missing"),
    ("sglang", _set(["meta_info", "output_token_logprobs"], [["x", 5, None]]),
     "meta_info.output_token_logprobs[0][0] is str 'x', not a number"),
    ("sglang", lambda r: [r, r], "a list of 2 answers"),
    ("openai-ids", lambda r: "ok", "the reply is str 'ok', not an object"),
    ("openai-ids", lambda r: {**r, "choices": r["choices"] * 2}, "holds 2 choices"),
]


@pytest.mark.parametrize(("protocol", "mutate", "names"), MALFORMED,
                         ids=[f"{p}-{n[:30]}" for p, _, n in MALFORMED])
def test_a_malformed_reply_is_a_server_error_naming_the_field_never_a_score(srv, tok, protocol, mutate, names):
    m = load(srv, tok, protocol)
    srv.mutate = mutate  # after the load: the evaluation's replies are the malformed ones
    with pytest.raises(ServerError) as err:
        evaluate(m, tok)
    msg = str(err.value)
    assert names in msg and LABELS[protocol] in msg and srv.url in msg, msg
    assert "No answer is scored" in msg and "\n" not in msg


def test_the_loaders_probes_and_lists_are_checked_too(srv, tok):
    srv.mutate = _set(["usage", "prompt_tokens"], "3")  # the text probe's count (before: ValueError from int())
    with pytest.raises(ServerError, match=r"usage\.prompt_tokens is str '3', not an integer"):
        load(srv, tok, "openai-text")
    srv.mutate = None
    srv.fault = lambda h, p: p == "/v1/models" and (h.send_json({"data": "faulty"}) or True)
    with pytest.raises(ServerError, match=r"GET /v1/models.*: data is str 'faulty', not a list"):
        load(srv, tok, "vllm")
    srv.fault = lambda h, p: p == "/v1/models" and (h.send_json({"data": [{"id": "m", "max_model_len": "4k"}]})
                                                    or True)
    with pytest.raises(ServerError, match=r"data\[0\]\.max_model_len is str '4k', not an integer"):
        load(srv, tok, "vllm")
    # a server's own /tokenize (no local tokenizer) whose ids are not integers
    srv.fault = lambda h, p: p == "/tokenize" and (h.send_json({"tokens": ["x"]}) or True)
    with pytest.raises(ServerError, match=r"/tokenize.*: tokens\[0\] is str 'x', not an integer"):
        phaselens.load(srv.url, stride=4, protocol="vllm", progress=False, retries=0)



def _html(handler, path):
    """A completion answered with a page that is not JSON (a proxy's error page, served with status 200)."""
    if path != "/v1/completions":
        return False
    page = b"<html>502 Bad Gateway</html>"
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(page)))
    handler.end_headers()
    handler.wfile.write(page)
    return True


def test_a_body_that_is_not_json_is_a_server_error_quoting_it(srv, tok):
    """The loader's dialect probe and every completion read their body through one check (Endpoint.decoded)."""
    srv.fault = _html
    with pytest.raises(ServerError, match=r"answered a probe prompt with something that is not JSON: '<html>502"):
        load(srv, tok, "auto")
    srv.fault = None
    m = load(srv, tok, "openai-ids")
    srv.fault = _html
    with pytest.raises(ServerError, match=r"answered POST /completions with something that is not JSON: '<html>"):
        evaluate(m, tok)


VALID = {
    "vllm": {"choices": [{"text": " cat", "token_ids": [5], "prompt_token_ids": [1, 2],
                          "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5],
                                       "top_logprobs": [{"token_id:5": -0.5, "token_id:3": -1.5}]}}],
             "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}},
    "sglang": {"output_ids": [5], "meta_info": {"prompt_tokens": 2, "cached_tokens": 0,
                                                "output_token_logprobs": [[-0.5, 5, None]],
                                                "output_token_ids_logprobs": [[[-0.5, 5, None], [-1.5, 3, None]]]}},
    "openai-text": {"choices": [{"text": " cat", "logprobs": None}], "usage": {"prompt_tokens": 2}},
}
JUNK = [None, "x", "", "token_id:x", 1.5, -1, 2, True, 10**30, float("nan"), [], {}, [None], ["x"], {"a": "b"}, ...]


def _paths(value, prefix=()):
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


@pytest.mark.parametrize("dialect", sorted(VALID))
def test_every_single_field_fault_is_read_exactly_or_refused(tok, dialect):
    """The class, not the cases: each field of a valid reply set to each junk value (or deleted) is either
    read into a well-typed reply or a ServerError; never a raw TypeError / KeyError / ValueError, and never a
    predicted id of -1 from a dialect that names tokens by id."""
    vocab, d = Vocabulary(tok), Dialect(dialect)
    refused = read = 0
    for path in list(_paths(VALID[dialect]))[1:]:
        for junk in JUNK:
            reply = _set(list(path), junk)(VALID[dialect])
            try:
                r = d.read(reply, 5, 3, vocab)
            except ServerError as err:
                assert "cannot read exactly" in str(err)
                refused += 1
                continue
            read += 1
            assert isinstance(r.predicted, int) and not isinstance(r.predicted, bool)
            assert r.predicted >= 0 or dialect == "openai-text", (path, junk)
            assert r.prompt_tokens is None or (type(r.prompt_tokens) is int and r.prompt_tokens >= 0)
            for lp in (r.logp_predicted, r.logp_answer, r.logp_wrong):
                assert isinstance(lp, float) and (math.isnan(lp) or lp <= 1e-4), (path, junk, r)
    assert refused > 50 and read > 5  # both outcomes occur: the check is neither vacuous nor blanket


# ---- deadlines ------------------------------------------------------------------------------------------------
def _timed(call):
    t0 = time.monotonic()
    with pytest.raises(ServerError) as err:
        call()
    return time.monotonic() - t0, str(err.value)


def test_a_retry_after_past_the_deadline_is_not_waited(srv):
    ep = Endpoint(srv.url, timeout=DEADLINE, retries=5)
    for retry_after in ("30", formatdate(time.time() + 45, usegmt=True)):  # seconds, and an HTTP date
        srv.fault, srv.requests[:] = busy(retry_after), []
        took, msg = _timed(lambda: ep.request("POST", "/completions", {}))
        assert took < DEADLINE and len(srv.requests) == 1, (took, srv.requests)
        assert f"timeout={DEADLINE:g} s" in msg and "past the deadline" in msg and "HTTP 503" in msg
    ep.close()


def test_retries_and_their_waits_end_at_the_deadline(srv):
    srv.fault = busy("0.2")
    ep = Endpoint(srv.url, timeout=DEADLINE, retries=1000)
    took, msg = _timed(lambda: ep.request("POST", "/completions", {}))
    assert DEADLINE - 0.5 < took < DEADLINE + SLACK and len(srv.requests) >= 3
    assert f"timeout={DEADLINE:g} s" in msg and srv.url in msg
    ep.close()


@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_trickled_reply_is_cut_at_the_deadline(srv, where):
    """One byte every 0.2 s: each read succeeds, so a per-read timeout never fires (200 bytes: 40 s); the
    request's deadline does."""
    srv.fault = trickle(srv, where=where, every=0.2, n=200)
    ep = Endpoint(srv.url, timeout=DEADLINE, retries=3)
    took, msg = _timed(lambda: ep.request("POST", "/completions", {}))
    assert took < DEADLINE + SLACK and f"within timeout={DEADLINE:g} s" in msg
    assert ("reading the reply's body" in msg and "bytes had arrived" in msg) if where == "body" else (
        "waiting for the reply" in msg)
    assert len(srv.requests) == 1  # the deadline covers the attempts: none starts after it
    ep.close()


def test_a_slow_reply_within_the_deadline_is_read(srv):
    srv.fault = trickle(srv, where="body", every=0.05, n=6)
    ep = Endpoint(srv.url, timeout=3.0, retries=0)
    resp = ep.request("POST", "/completions", {})
    assert resp.status_code == 200 and resp.content == b" " * 6
    ep.close()


def test_an_evaluation_on_a_trickling_server_stops_at_the_deadline(srv, tok):
    m = load(srv, tok, "vllm", timeout=DEADLINE, concurrency=4)
    evaluate(m, tok)  # well-formed first: what the evaluation itself costs (and its first imports) is not timed
    srv.fault = trickle(srv, where="body", every=0.2, n=200)
    took, msg = _timed(lambda: evaluate(m, tok))
    assert took < DEADLINE + 2 * SLACK and "reading the reply's body" in msg
    m.close()


def test_a_failed_batch_cancels_its_requests_still_in_flight(srv, tok):
    """The first reply is malformed; the batch's other requests, still trickling in with a minute left before
    their deadline, are cancelled with it: the server sees their connections close at once."""
    import threading

    slow, lock, first = trickle(srv, where="body", every=0.1, n=600), threading.Lock(), []

    def fault(handler, path):
        if path != "/v1/completions":
            return False
        with lock:
            mine, _ = not first, first.append(path)
        if not mine:
            return slow(handler, path)
        time.sleep(0.5)  # the others are trickling by now
        handler.send_json({"choices": []})
        return True

    m = load(srv, tok, "vllm", timeout=60.0, concurrency=4)
    evaluate(m, tok)  # well-formed first: the evaluation's own first imports are not timed
    srv.fault = fault
    took, msg = _timed(lambda: evaluate(m, tok))
    assert took < 0.5 + SLACK and "choices is an empty list" in msg
    end = time.monotonic() + 2 * SLACK
    while len(srv.hangups) < len(first) - 1 and time.monotonic() < end:
        time.sleep(0.05)
    # every trickling request was hung up on (at least the three in flight with the first; a queued one may
    # have started before the pool stopped)
    assert len(first) >= 4 and len(srv.hangups) == len(first) - 1
    m.close()


# ---- options checked at load ------------------------------------------------------------------------------------
BAD_OPTIONS = [
    ({"timeout": 0}, "timeout .* must be a finite number > 0"),
    ({"timeout": -5}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": "30"}, "timeout"),
    ({"timeout": 1e9}, r"timeout .* in 0\.\.604800 seconds"),
    ({"n_ctx": -10}, r"n_ctx .* must be >= 1, got -10"),
    ({"n_ctx": 0}, "n_ctx"),
    ({"n_ctx": 100.0}, "n_ctx"),
    ({"concurrency": 0}, r"concurrency .* must be >= 1, got 0"),
    ({"concurrency": 10**6}, "concurrency"),
    ({"retries": -1}, r"retries .* must be >= 0"),
    ({"retries": True}, "retries"),
    ({"backoff": -0.5}, r"backoff .* in 0\.\.3600 seconds"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"stride": 0}, "stride"),
    ({"window": -4}, "window"),
    ({"origin": -1}, "origin"),
    ({"warm_prefix": "no"}, "warm_prefix must be True or False"),
    ({"progress": "yes"}, "progress must be True or False"),
    ({"model": ""}, "model must be a non-empty string"),
    ({"protocol": "grpc"}, "protocol must be 'auto' or one of"),
]


@pytest.mark.parametrize(("kw", "match"), BAD_OPTIONS, ids=[f"{next(iter(k))}={next(iter(k.values()))!r}"
                                                             for k, _ in BAD_OPTIONS])
def test_options_are_checked_at_load_before_anything_is_sent(tok, kw, match):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: a check after a request would be a ServerError
    kw = {"stride": 4, **kw}
    with pytest.raises(InputError, match=match):
        phaselens.load(url, tokenizer=tok, retries=kw.pop("retries", 0), **kw)


def test_n_ctx_beyond_the_servers_context_is_refused_at_load(tok, token):
    with FaultyServer(tok, token=token, max_model_len=512) as srv:
        with pytest.raises(InputError, match=r"n_ctx=600 .* max_model_len is 512.* at most 511"):
            load(srv, tok, "vllm", n_ctx=600)
        m = load(srv, tok, "vllm")
        assert m.dims.n_ctx == 511 and load(srv, tok, "vllm", n_ctx=200).dims.n_ctx == 200


def test_an_endpoint_dropped_unclosed_closes_its_connections(srv):
    """A model re-made in a notebook cell without ``close()``: once collected, its pooled keep-alive connections
    are closed on the I/O loop (no ``ResourceWarning: unclosed transport`` later, from whatever code runs then)."""
    import gc
    import warnings

    ep = Endpoint(srv.url, timeout=5.0, retries=0)
    assert ep.request("POST", "/completions", {"prompt": "a", "max_tokens": 1}).status_code == 200
    client = ep.client
    assert client._transport._pool.connections  # one keep-alive connection, open
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        del ep
        gc.collect()
        for _ in range(100):
            if client.is_closed and not client._transport._pool.connections:
                break
            time.sleep(0.02)
        gc.collect()
    assert client.is_closed and not client._transport._pool.connections
    assert not [w for w in rec if issubclass(w.category, ResourceWarning)], [str(w.message) for w in rec]


def test_a_served_model_closes_its_connections_as_a_context_manager(srv, tok):
    with load(srv, tok, "vllm") as m:
        assert m.endpoint.client._transport._pool.connections  # the load's probes left one open
    assert m.endpoint.client.is_closed
