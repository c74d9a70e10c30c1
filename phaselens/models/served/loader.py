"""``phaselens.load("http://HOST:PORT/v1", ...)``: find the served model, its tokens and its dialect.

At load, before any item runs:

1. ``GET /v1/models`` names the model (the only one, or ``model=``) and says who serves it (``owned_by``);
   a dead or unreachable server is a :class:`~phaselens.errors.ServerError` naming the address;
2. the tokenizer is the local one (``tokenizer=``), else the server's ``/tokenize`` (vLLM, SGLang);
3. the dialect: vLLM and SGLang by their ``owned_by``, others by whether a token-id prompt is accepted with
   the right ``usage.prompt_tokens``;
4. the tokens are compared: against the server's ``/tokenize`` where it has one, else by sending one text
   prompt and checking the count. A server that tokenizes differently is refused here, with what differs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from phaselens.core.checks import as_float, as_int
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import InputError, TokenizerMismatchError
from phaselens.models.served.endpoint import Endpoint
from phaselens.models.served.model import ServedModel, mismatch_message
from phaselens.models.served.protocols import Dialect
from phaselens.models.served.replies import DIALECTS, validated
from phaselens.models.served.vocabulary import Vocabulary, load_tokenizer, server_vocabulary
from phaselens.storage.reading import peek_json

PROBES = ("Records: cat: Alice. dog: Bob.\nLookup: cat:", "x = y  # a line of code\n    return x == 8", "1 2 3 = = =")
DEFAULT_CONCURRENCY = {"vllm": 32, "sglang": 32, "openai-ids": 4, "openai-text": 2}


def load_served(url: str, *, model: str | None = None, tokenizer: Any = None, stride: int | None = None,
                window: int | None = None, origin: int = 0, concurrency: int | None = None, protocol: str = "auto",
                top_logprobs: int = 20, timeout: float = 3600.0, retries: int = 6, backoff: float = 1.0,
                n_ctx: int | None = None, warm_prefix: bool | None = None, default_task: Any = None,
                progress: bool = True, api_key: str | None = None) -> ServedModel:
    """A :class:`~phaselens.models.served.model.ServedModel` for the server at ``url``.

    Args:
        url: ``http://HOST:PORT/v1`` (``/v1`` may be left out).
        model: the served model's name (default: the only entry of ``/v1/models``).
        tokenizer: the served checkpoint's ``tokenizer.json``, its folder, or a tokenizer object; ``None`` uses
            the server's ``/tokenize`` (vLLM, SGLang).
        stride, window, origin: the phase geometry (default: read from ``config.json`` beside the tokenizer:
            the smallest compression ratio above 1, e.g. 4 for DeepSeek-V4, 2 for V4.1).
        concurrency: requests in flight (default by server: 32 for vLLM and SGLang, 2 for ``transformers serve``).
        protocol: ``"auto"`` or one of ``vllm``, ``sglang``, ``openai-ids``, ``openai-text``.
        top_logprobs: log-probabilities asked per reply (vLLM's default ``--max-logprobs`` is 20).
        timeout: the deadline of each request in seconds: every attempt, the waits between them (``Retry-After``
            included) and the reply's body however slowly it arrives (default 3600: a 128K prefill behind a queue).
        retries, backoff: attempts after the first; the first wait in seconds (doubling, at most 60 s).
        n_ctx: the longest prompt (default: one less than the server's ``max_model_len`` where it says: the
            answer takes a slot too).
        warm_prefix: hold prompts that share a long prefix behind the first (default: on for vLLM and SGLang).
        default_task, progress, api_key: the task ``evaluate(model)`` uses; the requests' progress bar; a key.
    """
    opts = _options(model=model, stride=stride, window=window, origin=origin, concurrency=concurrency,
                    protocol=protocol, top_logprobs=top_logprobs, timeout=timeout, retries=retries, backoff=backoff,
                    n_ctx=n_ctx, warm_prefix=warm_prefix, progress=progress, api_key=api_key)
    spec = served_geometry(tokenizer, stride, window, origin)  # local: before anything is sent
    conc = opts["concurrency"]
    endpoint = Endpoint(url, timeout=opts["timeout"], retries=opts["retries"], backoff=opts["backoff"],
                        connections=max(conc or 0, 64) + 4, api_key=api_key)
    try:
        name, card = _choose_model(endpoint, model)
        vocab = Vocabulary(load_tokenizer(tokenizer)) if tokenizer is not None else server_vocabulary(endpoint, name)
        checks: dict[str, Any] = {}
        dialect = _dialect(endpoint, name, vocab, card, protocol, opts["top_logprobs"], checks)
        _compare_tokens(endpoint, name, vocab, dialect, checks, local=tokenizer is not None)
        ctx = _context(endpoint, card, tokenizer, opts["n_ctx"])
    except BaseException:
        endpoint.close()  # no connections left open behind a refused load
        raise
    conc = conc or DEFAULT_CONCURRENCY[dialect.name]
    warm = dialect.name in ("vllm", "sglang") if warm_prefix is None else bool(warm_prefix)
    return ServedModel(endpoint, name, vocab, dialect, spec=spec, n_ctx=ctx, concurrency=conc, warm_prefix=warm,
                       default_task=default_task, progress=progress, checks=checks)


def _choose_model(endpoint: Endpoint, model: str | None) -> tuple[str, dict[str, Any]]:
    data = endpoint.json("GET", "/models", what="the model list (GET /v1/models)")
    cards = validated(data, "models", f"the server at {endpoint.api}")["data"]
    names = [str(c.get("id")) for c in cards]
    if model is None:
        if len(cards) != 1:
            raise InputError(f"the server at {endpoint.api} serves {len(cards)} models ({', '.join(names) or 'none'}); "
                             "pass model=NAME (--served-model NAME) to pick one.")
        return names[0], cards[0]
    if str(model) not in names:
        raise InputError(f"the server at {endpoint.api} does not serve {model!r}; it serves: {', '.join(names)}.")
    return str(model), cards[names.index(str(model))]


def _dialect(endpoint: Endpoint, name: str, vocab: Vocabulary, card: dict[str, Any], protocol: str, top: int,
             checks: dict[str, Any]) -> Dialect:
    if protocol != "auto":
        checks["protocol"] = f"{protocol} (given)"
        return Dialect(protocol, top)
    owner = str(card.get("owned_by", "")).lower()
    if owner in ("vllm", "sglang"):
        checks["protocol"] = f"{owner}: /v1/models says owned_by={owner!r}"
        return Dialect(owner, top)
    ids = vocab.encode(PROBES[0], special=True)
    resp = endpoint.request("POST", "/completions", {"model": name, "prompt": ids, "max_tokens": 1,
                                                     "temperature": 0.0})
    counted = None
    if resp.status_code < 400:  # taken: the reply must read as a completion
        data = validated(endpoint.decoded(resp, "a probe prompt"), "openai-ids", f"the server at {endpoint.api}")
        counted = (data.get("usage") or {}).get("prompt_tokens")
    if counted == len(ids):
        checks["protocol"] = "openai-ids: a token-id prompt was taken with the right usage.prompt_tokens"
        return Dialect("openai-ids", top)
    why = (f"HTTP {resp.status_code}" + (f" {_json(resp).get('detail', '')}" if resp.status_code >= 400 else
                                          f", usage.prompt_tokens {counted} for {len(ids)} ids")).strip()
    checks["protocol"] = f"openai-text: a token-id prompt was not taken ({why})"
    return Dialect("openai-text", top)


def _compare_tokens(endpoint: Endpoint, name: str, vocab: Vocabulary, dialect: Dialect, checks: dict[str, Any], *,
                    local: bool) -> None:
    """Refuse a local tokenizer that disagrees with the server's (see the module docstring)."""
    if not local:
        checks["tokenizer"] = "the server's own /tokenize"
        return
    server = f"the server at {endpoint.api}"
    resp = endpoint.request("POST", "/tokenize", {"model": name, "prompt": PROBES[0]}, root=True, retries=1)
    if resp.status_code < 400 and isinstance(_json(resp).get("tokens"), list):
        for text in PROBES:
            theirs = validated(endpoint.json("POST", "/tokenize", {"model": name, "prompt": text,
                                                                   "add_special_tokens": True},
                                             root=True, what="a /tokenize request"), "tokenize", server).get("tokens")
            ours = vocab.encode(text, special=True)
            if theirs != ours:
                raise TokenizerMismatchError(
                    f"the server at {endpoint.api} tokenizes {text!r} as {theirs[:12]} where the local tokenizer gives "
                    f"{ours[:12]}: pass the served checkpoint's own tokenizer (its phases would be wrong otherwise).")
        checks["tokenizer"] = f"agrees with the server's /tokenize on {len(PROBES)} probe texts"
        return
    if dialect.name in ("vllm", "sglang"):
        checks["tokenizer"] = "not compared (the server offers no /tokenize)"
        return
    for text in PROBES:  # a text prompt's count must match the local one
        ids = vocab.encode(text, special=True)
        data = endpoint.json("POST", "/completions", {"model": name, "prompt": text,
                                                       "max_tokens": 1, "temperature": 0.0}, what="a probe prompt")
        counted = validated(data, "openai-text", server)["usage"]["prompt_tokens"]  # required in this dialect
        if counted != len(ids):
            raise TokenizerMismatchError(mismatch_message(endpoint.api, counted, len(ids), vocab.prefix, False))
    checks["tokenizer"] = f"prompt token counts agree on {len(PROBES)} probe texts (then on every reply)"


def _json(resp: Any) -> Any:
    """A probe's JSON object: ``{}`` when its body is not one."""
    try:
        out = resp.json()
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _context(endpoint: Endpoint, card: dict[str, Any], tokenizer: Any, n_ctx: int | None) -> int:
    """The longest prompt: ``n_ctx``, else one less than the server's ``max_model_len`` (the answer takes a
    slot too) or the config's ``max_position_embeddings``; 0 when nothing says. An ``n_ctx`` the server's
    ``max_model_len`` cannot hold is refused here, not by the server on the first long prompt."""
    limit = card.get("max_model_len")
    if n_ctx is not None:
        if limit is not None and n_ctx > limit - 1:
            raise InputError(f"n_ctx={n_ctx} is more than the server at {endpoint.api} holds: its max_model_len is "
                             f"{limit}, so prompts of at most {limit - 1} tokens (the answer takes a slot); pass "
                             f"n_ctx={limit - 1} or less, or leave it out.")
        return n_ctx
    cfg = _config(tokenizer) or {}
    limit = limit or cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    if isinstance(limit, bool) or not isinstance(limit, int):
        return 0
    return max(limit - 1, 0)


def served_geometry(tokenizer: Any, stride: int | None, window: int | None = None, origin: int = 0) -> PhaseSpec:
    """The phase geometry: ``stride`` given, else from the ``config.json`` beside the tokenizer."""
    if stride is None:
        stride = stride_from_config(_config(tokenizer))
        if stride is None:
            raise InputError(
                "the served model's compression stride is unknown: pass stride=S (DeepSeek-V4: 4, V4.1: 2; a model "
                "without compression: the stride of the model you compare it with), or tokenizer=DIR of a checkpoint "
                "whose config.json gives its compression ratios."
            )
    return PhaseSpec(stride, window, origin)


def stride_from_config(config: dict[str, Any] | None) -> int | None:
    """The smallest compression ratio above 1 in a checkpoint's ``config.json`` (transformers' DeepSeek-V4
    ``compress_rates`` over its ``layer_types``, or the released ``compress_ratios``), else ``None``."""
    if not config:
        return None
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    rates: list[int] = []
    if isinstance(cfg.get("compress_rates"), dict):
        used = set(cfg.get("layer_types") or cfg["compress_rates"])
        rates += [int(r) for t, r in cfg["compress_rates"].items() if t in used]
    if isinstance(cfg.get("compress_ratios"), list):
        rates += [int(r) for r in cfg["compress_ratios"]]
    rates = [r for r in rates if r > 1]
    return min(rates) if rates else None


def _config(tokenizer: Any) -> dict[str, Any] | None:
    if not isinstance(tokenizer, str | os.PathLike):
        return None
    path = Path(tokenizer).expanduser()
    path = path if path.is_dir() else path.parent
    raw = peek_json(path / "config.json")
    return raw if isinstance(raw, dict) else None


#: The loader's numeric options: (kind, smallest, largest, what it is). Bounds keep every later computation
#: finite (a socket timeout, a backoff of 2**attempt seconds) and name what the option means.
MAX_TIMEOUT = 7 * 24 * 3600.0
NUMERIC = {
    "stride": ("int", 1, None, "the compression stride in tokens"),
    "window": ("int", 1, None, "the compressor's window in tokens"),
    "origin": ("int", 0, None, "the slot where block 0 begins"),
    "concurrency": ("int", 1, 1024, "requests in flight at once"),
    "top_logprobs": ("int", 0, 1024, "log-probabilities asked per reply (0: none)"),
    "timeout": ("float", 0.0, MAX_TIMEOUT, "seconds a request may take in all, retries and the reply's body "
                                          "included"),
    "retries": ("int", 0, 1000, "attempts after the first"),
    "backoff": ("float", 0.0, 3600.0, "seconds of the first wait between attempts"),
    "n_ctx": ("int", 1, None, "the longest prompt in tokens"),
}


def _options(**given: Any) -> dict[str, Any]:
    """The served loader's options, checked before anything is sent: a bad value is an ``InputError`` naming
    the option and its valid range (``timeout=0`` would otherwise blame a server that is up, ``n_ctx=-10``
    ask for prompts of at most -10 tokens)."""
    out = dict(given)
    for name, (kind, low, high, what) in NUMERIC.items():
        if given[name] is None and name in ("stride", "window", "concurrency", "n_ctx"):  # found at load
            continue
        label = f"{name} ({what})"
        if kind == "int":
            out[name] = as_int(label, given[name], minimum=low, maximum=high)
            continue
        out[name] = as_float(label, given[name], positive=name == "timeout")
        if not low <= out[name] <= high:
            raise InputError(f"{label} must be in {low:g}..{high:g} seconds, got {given[name]!r}.")
    if given["protocol"] != "auto" and given["protocol"] not in DIALECTS:
        raise InputError(f"protocol must be 'auto' or one of {DIALECTS}, got {given['protocol']!r}.")
    for name in ("warm_prefix", "progress"):
        if not isinstance(given[name], bool | np.bool_) and not (name == "warm_prefix" and given[name] is None):
            raise InputError(f"{name} must be True or False, got {given[name]!r}.")
    for name in ("model", "api_key"):
        if given[name] is not None and (not isinstance(given[name], str) or not given[name]):
            raise InputError(f"{name} must be a non-empty string (or left out), got {given[name]!r}.")
    return out
