"""The paper's two black-box measurements as tasks built from a model's own tokenizer.

* ``niah-128k`` (:func:`niah_128k`): a needle among about 16,000 four-token key -> value records in a
  128K-token prompt. The target key's residue varies while the question, the records and the length stay
  fixed (a paired design: every item at every residue), with the padding placed after a shared prefix so a
  prefix-caching server prefills most of the haystack once per item.
* ``fp8-probe`` (:func:`fp8_probe`): the FP8 code completion whose answer is ``8`` (not ``32``) under a
  docstring line of ``" ="`` padding (:meth:`~phaselens.tasks.probe.PaddingProbe.fp8_example`).

Keys and values of the needle are words the tokenizer stores as one token after a space, checked to stay
one token inside the record template at both slots, so every record has exactly four tokens.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from phaselens.errors import TaskError
from phaselens.tasks.needle import Needle
from phaselens.tasks.probe import PaddingProbe
from phaselens.tasks.records import split_template
from phaselens.tasks.text import encode

TEMPLATE = " {key}: {value}."


def vocabulary_words(tokenizer: Any, *, template: str = TEMPLATE, min_chars: int = 2) -> tuple[str, ...]:
    """ASCII words (``min_chars`` letters or more) that the tokenizer stores as one token after a space and that
    stay one token at both slots of ``template`` (no merge with the punctuation around them), in id order."""
    lit0, key_ws, lit1, value_ws, lit2 = split_template(template)
    size = tokenizer.get_vocab_size() if callable(getattr(tokenizer, "get_vocab_size", None)) else len(tokenizer)
    words = []
    for tid in range(size):
        text = tokenizer.decode([tid])
        word = text[1:]
        if not (text.startswith(" ") and word.isascii() and word.isalpha() and len(word) >= min_chars):
            continue
        if encode(tokenizer, key_ws + word) != [tid] or encode(tokenizer, value_ws + word) != [tid]:
            continue
        words.append(word)
    lits = [encode(tokenizer, t) for t in (lit0, lit1, lit2)]
    sample = template.format(key=words[0], value=words[0]) if words else ""
    if words:  # one assembled record: literals and words stay apart (checked on all items at build time)
        tid = encode(tokenizer, key_ws + words[0])[0]
        want = [*lits[0], tid, *lits[1], tid, *lits[2]]
        if encode(tokenizer, sample) != want:
            raise TaskError(f"the record template {template!r} does not tokenize as its pieces with this tokenizer "
                            f"({sample!r}); choose another template.")
    return tuple(words)


def niah_128k(tokenizer: Any, *, length: int = 131072, n_records: int = 16000, modulus: int = 8, n_demos: int = 2,
              padding: str = "shared_prefix", paired: bool = True, seed: int = 0, words: Any = None,
              **overrides: Any) -> Needle:
    """The paper's 128K needle: ``n_records`` four-token records and filler up to ``length`` tokens.

    Keys and values are drawn from :func:`vocabulary_words` (shuffled by ``seed``; keys and values come from
    disjoint halves when there are enough words). The filler between records (``block_filler``) makes the
    prompt as long as ``length`` allows. ``overrides`` go to :class:`~phaselens.tasks.needle.Needle`.
    """
    pool = list(words) if words is not None else list(vocabulary_words(tokenizer))
    if len(pool) < n_records:
        raise TaskError(f"the tokenizer has {len(pool)} single-token words for {n_records} records; pass "
                        f"n_records={len(pool)} or fewer, or words=[...] of your own.")
    random.Random(seed).shuffle(pool)
    half = len(pool) // 2
    keys, values = (pool[:half], pool[half:]) if half >= n_records else (pool, pool)
    task = Needle(tokenizer, keys=tuple(keys), values=tuple(values), n_records=n_records, n_demos=n_demos,
                  modulus=modulus, padding=padding, paired=paired, **overrides)
    base = task.seq_len()
    if base > length:
        raise TaskError(f"{n_records} records need {base:,} tokens, more than length={length:,}; use fewer records.")
    filler = (length - base) // 2  # each filler unit sits in the block and widens the padding by one
    while filler > 0 and dataclasses.replace(task, block_filler=filler).seq_len() > length:
        filler -= 1
    return dataclasses.replace(task, block_filler=filler) if filler else task


def fp8_probe(tokenizer: Any, **overrides: Any) -> PaddingProbe:
    """The FP8 code-completion probe (answer ``8``, distractor ``32``) under ``" ="`` padding."""
    return PaddingProbe.fp8_example(tokenizer, **overrides)


PRESETS: dict[str, Callable[..., Any]] = {"niah-128k": niah_128k, "fp8-probe": fp8_probe}
PRESET_ITEMS = {"niah-128k": 256, "fp8-probe": 4}  # items per residue the paper's measurement uses


def preset(name: str, tokenizer: Any, **kwargs: Any) -> Any:
    """The preset task ``name`` (:data:`PRESETS`) built from ``tokenizer``."""
    if name not in PRESETS:
        raise TaskError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}.")
    return PRESETS[name](tokenizer, **kwargs)
