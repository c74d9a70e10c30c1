"""The served model's tokens, known locally: the tokenizer that turns the tasks' text into the server's ids.

A local tokenizer (``tokenizer.json``, a checkpoint directory, or an object already loaded) is the normal way.
Without one, a server's own ``/tokenize`` and ``/detokenize`` (vLLM, SGLang) stand in for it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from phaselens.errors import InputError, ServerError
from phaselens.models.served.replies import refuse, validated
from phaselens.tasks.text import encode, special_prefix


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object from a path (``tokenizer.json`` or a directory holding it) or an object as it is."""
    if not isinstance(tokenizer, str | os.PathLike):
        if not callable(getattr(tokenizer, "encode", None)) or not callable(getattr(tokenizer, "decode", None)):
            raise InputError(f"tokenizer must be a path or a tokenizer (tokenizers.Tokenizer, a transformers "
                             f"tokenizer), got {type(tokenizer).__name__}.")
        return tokenizer
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise InputError(f"{path} holds no tokenizer.json; pass the checkpoint's tokenizer.json or its folder.")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
            raise InputError(f"{path} is not a tokenizer.json the tokenizers library can read ({err}).") from None
    raise InputError(f"no tokenizer at {path}; pass the checkpoint's tokenizer.json or its folder.")


class Vocabulary:
    """What phaselens needs of the served model's tokenizer: encode, decode, the special prefix it adds (BOS),
    its size and a fingerprint (results and journals record which tokenizer made the ids).

    Calls are serialized: the requests' threads share one tokenizer, and a transformers fast tokenizer used
    from two threads at once can fail ("Already borrowed")."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self.prefix = tuple(special_prefix(tokenizer))

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        with self._lock:
            return encode(self.tokenizer, text, special=special)

    def decode(self, ids: Any) -> str:
        ids = [int(i) for i in ids]
        with self._lock:
            try:
                return self.tokenizer.decode(ids, skip_special_tokens=False)
            except TypeError:  # a tokenizer whose decode takes no such keyword
                return self.tokenizer.decode(ids)

    @property
    def size(self) -> int:
        tok = self.tokenizer
        if callable(getattr(tok, "get_vocab_size", None)):
            return int(tok.get_vocab_size(with_added_tokens=True))
        return int(len(tok))

    def fingerprint(self) -> str:
        """A sha256 of the tokenizer's full definition (vocabulary, merges, normalizer, specials)."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None) or tok
        to_str = getattr(backend, "to_str", None)
        text = to_str() if callable(to_str) else repr(sorted(tok.get_vocab().items()))
        return hashlib.sha256(text.encode()).hexdigest()


class ServerVocabulary(Vocabulary):
    """The server's own ``/tokenize`` and ``/detokenize`` (vLLM, SGLang) in place of a local tokenizer."""

    def __init__(self, endpoint: Any, model: str) -> None:
        self.endpoint, self.model = endpoint, model
        self._cache: dict[tuple[str, bool], list[int]] = {}
        self.tokenizer = self
        self.prefix = tuple(_prefix(self))

    def encode(self, text: str, *, special: bool = False, add_special_tokens: bool | None = None) -> list[int]:
        special = special if add_special_tokens is None else bool(add_special_tokens)
        key = (text, special)
        if key not in self._cache:
            out = validated(self.endpoint.json("POST", "/tokenize", {"model": self.model, "prompt": text,
                                                                     "add_special_tokens": special}, root=True,
                                               what="a /tokenize request"), "tokenize", self._server)
            ids = out.get("tokens", out.get("input_ids"))
            if ids is None:
                refuse(self._server, "tokenize", "tokens", "is missing (and so is input_ids)")
            self._cache[key] = list(ids)
        return list(self._cache[key])

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        out = validated(self.endpoint.json("POST", "/detokenize", {"model": self.model, "tokens": [int(i) for i in ids]},
                                           root=True, what="a /detokenize request"), "detokenize", self._server)
        text = out.get("prompt", out.get("text"))
        if text is None:
            refuse(self._server, "detokenize", "prompt", "is missing (and so is text)")
        return text

    @property
    def _server(self) -> str:
        return f"the server at {self.endpoint.api}"

    @property
    def size(self) -> int:
        return 0  # unknown: the ids' range is not checked locally

    def fingerprint(self) -> str:
        probe = "phaselens: the quick brown fox = = = 0123456789\n"
        return hashlib.sha256(f"server:{self.model}:{self.encode(probe, special=True)}".encode()).hexdigest()


def _prefix(vocab: ServerVocabulary) -> list[int]:
    plain, full = vocab.encode("x"), vocab.encode("x", special=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i]
    return []


def server_vocabulary(endpoint: Any, model: str) -> ServerVocabulary:
    """The server's tokenizer through ``/tokenize``; a clear error naming ``tokenizer=`` when it has none."""
    resp = endpoint.request("POST", "/tokenize", {"model": model, "prompt": "x"}, root=True, retries=1)
    if resp.status_code >= 400:
        raise ServerError(
            f"the server at {endpoint.api} has no /tokenize endpoint (HTTP {resp.status_code}), so phaselens cannot "
            "learn its tokens; pass tokenizer=PATH (the served checkpoint's tokenizer.json or its folder), "
            "or --tokenizer PATH on the command line."
        )
    return ServerVocabulary(endpoint, model)
