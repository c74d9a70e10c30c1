"""A small byte-level BPE trained on the spot, for examples and tests that must not download anything."""

from __future__ import annotations

import random
from collections.abc import Sequence
from importlib import resources

from phaselens.tasks.records import DEFAULT_KEYS, DEFAULT_VALUES


def toy_corpus(seed: int = 0, n_lines: int = 400) -> list[str]:
    """Lines that exercise the default Needle pools, the FP8 example and ``=`` padding."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        recs = "".join(f" {rng.choice(DEFAULT_KEYS)}: {rng.choice(DEFAULT_VALUES)}." for _ in range(4))
        lines.append(f"Records:{recs} . .\nLookup: {rng.choice(DEFAULT_KEYS)}: {rng.choice(DEFAULT_VALUES)}.")
        lines.append("x == y and x==y, a = b = c; " + " =" * rng.randint(1, 6))
    fp8 = resources.files("phaselens.tasks").joinpath("examples", "fp8_quant.py.txt").read_text()
    code = fp8.replace("<|pad|>", " = = =").replace("<|cursor|>", "")
    lines += [code, code.replace("float8_e4m3fn", "float32")] * 20
    return lines


def train_toy_tokenizer(extra_texts: Sequence[str] = (), *, vocab_size: int = 1000, seed: int = 0):
    """A ``tokenizers.Tokenizer`` (byte-level BPE, ``<bos>`` prepended by its post-processor).

    Every default Needle key and value is one token (with its leading space), ``" ="`` is one token and
    ``"=="`` is a learned merge (so ``"="`` is a padding unit that merges with itself).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*toy_corpus(seed), *extra_texts], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    return tok
