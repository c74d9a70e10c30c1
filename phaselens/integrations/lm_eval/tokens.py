"""The model's tokenizer as lm-eval's models use it: text to ids with the tokenizer's special prefix (BOS), ids to
text, and the special ids; any tokenizer phaselens reads (a transformers tokenizer, a ``tokenizers.Tokenizer``,
a path, or ``zoo:NAME`` for the zoo's word-level tokenizer)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from phaselens.errors import InputError
from phaselens.tasks.text import encode, special_prefix


def load_any_tokenizer(spec: Any) -> Any:
    """A tokenizer from ``spec``: an object as it is, ``zoo:NAME`` (that zoo model's word-level tokenizer), or a
    path (a ``tokenizer.json`` or a folder holding one; never a download)."""
    if isinstance(spec, str) and spec.startswith("zoo:"):
        import json

        from phaselens.models.word_tokenizer import word_tokenizer
        from phaselens.models.zoo import entry

        config = json.loads((entry(spec[4:]).path / "config.json").read_text())
        return word_tokenizer(int(config["config"]["d_vocab"]))
    from phaselens.models.served.vocabulary import load_tokenizer

    return load_tokenizer(os.fspath(spec) if isinstance(spec, os.PathLike) else spec)


def tokenizer_name(tok: Any) -> str:
    """What messages and results call a tokenizer: its path or name, else its class and size."""
    name = getattr(tok, "name_or_path", None)
    if name:
        return str(name)
    size = tok.get_vocab_size() if callable(getattr(tok, "get_vocab_size", None)) else len(tok)
    return f"{type(tok).__name__} of {size} tokens"


class TokenizerView:
    """Encoding and decoding as lm-eval's ``hf`` model does them, over any tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.name = tokenizer_name(tokenizer)
        self.prefix = tuple(int(i) for i in special_prefix(tokenizer))
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_id = int(eos) if isinstance(eos, int) else None
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Ids of ``text``; the special prefix is added unless ``add_special_tokens`` is False or (None) the text
        already begins with it."""
        plain = self._encode(text, special=False)
        if add_special_tokens is False or (add_special_tokens is None and self.prefix
                                           and tuple(plain[:len(self.prefix)]) == self.prefix):
            return plain
        return self._encode(text, special=True)

    def _encode(self, text: str, *, special: bool) -> list[int]:
        try:
            return [int(i) for i in encode(self.tokenizer, text, special=special)]
        except Exception as err:  # tokenizers raises a bare Exception for a word outside a word-level vocabulary
            raise InputError(f"the tokenizer {self.name} cannot encode {text[:60]!r} ({err}); the text must be in the "
                             "model's vocabulary (the zoo's words are t0, t1, ...).") from None

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:  # a tokenizer whose decode takes no such keyword
            return self.tokenizer.decode(ids)
