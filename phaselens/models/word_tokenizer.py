"""A word-level tokenizer for models whose vocabulary is synthetic ids (the zoo): id ``N`` is the word ``tN``.

Text is words separated by whitespace; encoding puts the BOS word in front (``t1``, as the zoo's tasks do) and
decoding joins words with single spaces, so ``decode(encode(text))`` is the text with its whitespace normalized
and every id round-trips exactly. It is a transformers ``PreTrainedTokenizerFast`` built in code (nothing is
read or downloaded), so lm-evaluation-harness, ``model.to_str_tokens`` and phaselens' text tasks use it as any
other tokenizer.
"""

from __future__ import annotations

from typing import Any

from phaselens.errors import InputError

# the zoo's fixed ids (phaselens.tasks.kv_recall): 0 PAD, 1 BOS, 2 QUERY
ZOO_PAD, ZOO_BOS = 0, 1


def word(token_id: int) -> str:
    """The word of ``token_id``: ``tN``."""
    return f"t{int(token_id)}"


def word_tokenizer(vocab_size: int, *, bos_id: int | None = ZOO_BOS, pad_id: int | None = ZOO_PAD,
                   eos_id: int | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` over the words ``t0 .. t{vocab_size-1}`` (id N is ``tN``).

    Args:
        vocab_size: the model's ``d_vocab``.
        bos_id: the id encoding puts first (``add_special_tokens=True``, the default), or ``None`` for none.
        pad_id, eos_id: the ids transformers and lm-eval read as padding and end of text (``None``: none).

    A word outside the vocabulary is an unknown token: encoding raises (there is no ``[UNK]`` id to map it to,
    and mapping it to a real id would be a silent wrong answer).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise InputError(f"vocab_size must be a positive int, got {vocab_size!r}.")
    for name, value in (("bos_id", bos_id), ("pad_id", pad_id), ("eos_id", eos_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise InputError(f"{name}={value} lies outside the vocabulary 0..{vocab_size - 1}.")
    core = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    if bos_id is not None:
        core.post_processor = processors.TemplateProcessing(single=f"{word(bos_id)} $A",
                                                            special_tokens=[(word(bos_id), bos_id)])
    # single_word: a special word matches whole words only ("t1" must not split "t12" into "t1" + "2")
    specials = {key: AddedToken(word(value), single_word=True, normalized=False, special=True)
                for key, value in (("bos_token", bos_id), ("pad_token", pad_id), ("eos_token", eos_id))
                if value is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **specials)
    tok.model_max_length = 1 << 30  # the model's context bounds lengths, not the tokenizer
    return tok
