"""The zoo's word-level tokenizer (issue 47): id N is the word tN, every id round-trips, the BOS comes first, and a
special word never matches inside another word."""

from __future__ import annotations

import pytest

import phaselens
from phaselens.errors import InputError
from phaselens.models.word_tokenizer import word_tokenizer


def test_every_id_round_trips_and_the_bos_comes_first():
    tok = word_tokenizer(128, eos_id=2)
    ids = list(range(128))
    text = tok.decode(ids)
    assert text == " ".join(f"t{i}" for i in ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    assert tok("t5  t17\nt12")["input_ids"] == [1, 5, 17, 12]  # any whitespace separates words
    # the special words t0 (pad), t1 (BOS), t2 (EOS) match whole words only: t1 is not found inside t12
    assert tok("t12 t10 t1 t21", add_special_tokens=False)["input_ids"] == [12, 10, 1, 21]
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (1, 0, 2)
    assert tok.decode([1, 7, 2], skip_special_tokens=True) == "t7"


def test_a_word_outside_the_vocabulary_is_an_error_not_another_id():
    tok = word_tokenizer(16)
    with pytest.raises(Exception, match="Missing \\[UNK\\]"):
        tok("t5 t16")
    with pytest.raises(InputError, match="positive int"):
        word_tokenizer(0)
    with pytest.raises(InputError, match="bos_id=20 lies outside the vocabulary 0..15"):
        word_tokenizer(16, bos_id=20)


def test_a_zoo_model_loads_with_it(tmp_path):
    model = phaselens.load("zoo:w8s4")
    assert model.tokenizer("t3 t40")["input_ids"] == [1, 3, 40]
    assert model.to_tokens("t3 t40").tolist() == [[1, 3, 40]]
    with pytest.raises(InputError, match="texts encode to \\[2, 3\\] tokens"):
        model.to_tokens(["t3", "t3 t4"])  # no left padding: it would move every token's phase
    with pytest.raises(InputError, match="has no tokenizer; set model.tokenizer"):
        phaselens.models.CompressedTransformer(model.cfg).to_tokens("t3")  # a model built in code has none
    # saved and read back by transformers (what lm-eval's hf model and transformers serve read)
    from transformers import AutoTokenizer

    model.tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("t12 t1 t3")["input_ids"] == [1, 12, 1, 3]
