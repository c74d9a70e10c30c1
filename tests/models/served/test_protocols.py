"""How each server is asked and read, on replies shaped as vLLM's and SGLang's documented response models
(these paths need a GPU server to run end to end: tests/gpu/session.py checks them there), the geometry read
from a checkpoint's config, and the errors that name what differs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from phaselens.errors import InputError, TokenizerMismatchError
from phaselens.models.served import stride_from_config
from phaselens.models.served.endpoint import normalize_url
from phaselens.models.served.model import mismatch_message
from phaselens.models.served.protocols import Dialect, resolve_text
from phaselens.models.served.vocabulary import Vocabulary
from phaselens.tasks import train_toy_tokenizer


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(train_toy_tokenizer())


def test_vllm_requests_token_ids_and_reads_ids_logprobs_and_the_echo(vocab):
    d = Dialect("vllm", 20)
    path, root, body = d.request("m", [1, 2, 3], None, answer=42, wrong=7)
    assert (path, root) == ("/completions", False) and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 1
    assert body["temperature"] == 0.0 and body["logprobs"] == 20
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"]
    reply = d.read({
        "id": "cmpl-1", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": " Paris", "finish_reason": "length", "token_ids": [42],
                     "prompt_token_ids": [1, 2, 3],
                     "logprobs": {"text_offset": [0], "token_logprobs": [-0.25], "tokens": ["token_id:42"],
                                  "top_logprobs": [{"token_id:42": -0.25, "token_id:7": -2.5, "token_id:9": -3.0}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 16}},
    }, 42, 7, vocab)
    assert (reply.predicted, reply.logp_answer, reply.logp_wrong, reply.logp_predicted) == (42, -0.25, -2.5, -0.25)
    assert (reply.prompt_tokens, reply.cached_tokens, reply.echoed) == (3, 16, [1, 2, 3])
    outside = d.read({"choices": [{"token_ids": [9], "logprobs": {"token_logprobs": [-0.1], "tokens": ["token_id:9"],
                                                                  "top_logprobs": [{"token_id:9": -0.1}]}}],
                      "usage": {"prompt_tokens": 3}}, 42, 7, vocab)
    assert outside.predicted == 9 and math.isnan(outside.logp_answer)  # not among the top-K: unknown


def test_sglang_asks_for_the_answer_and_distractor_log_probabilities_by_id(vocab):
    d = Dialect("sglang", 5)
    path, root, body = d.request("m", [1, 2, 3], None, answer=42, wrong=7)
    assert (path, root) == ("/generate", True) and body["input_ids"] == [1, 2, 3]
    assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert body["return_logprob"] and body["token_ids_logprob"] == [7, 42] and body["top_logprobs_num"] == 5
    reply = d.read({"text": " Paris", "output_ids": [9], "meta_info": {
        "id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "completion_tokens": 1,
        "cached_tokens": 2, "output_token_logprobs": [[-0.1, 9, None]],
        "output_top_logprobs": [[[-0.1, 9, None], [-2.0, 42, None]]],
        "output_token_ids_logprobs": [[[-9.5, 7, None], [-2.0, 42, None]]]}}, 42, 7, vocab)
    assert (reply.predicted, reply.logp_predicted, reply.logp_answer, reply.logp_wrong) == (9, -0.1, -2.0, -9.5)
    assert (reply.prompt_tokens, reply.cached_tokens) == (3, 2)


def test_a_text_server_is_asked_in_text_and_read_back_through_the_tokenizer(vocab):
    d = Dialect("openai-text", 20)
    assert not d.takes_ids and d.prompts.startswith("text")
    _, _, body = d.request("m", [1, 2], "Records:", 3, 4)
    assert body["prompt"] == "Records:"
    cat = vocab.encode(" cat")
    assert len(cat) == 1
    reply = d.read({"choices": [{"text": " cat"}], "usage": {"prompt_tokens": 2}}, 99, 98, vocab)
    assert reply.predicted == cat[0] and math.isnan(reply.logp_answer) and reply.prompt_tokens == 2
    assert resolve_text(vocab, "", 1, 2) == -1 and resolve_text(vocab, "\ufffd", 1, 2) == -1


def test_mismatch_messages_say_what_differs():
    assert "adds 1 token(s) of its own" in mismatch_message("http://h/v1", 11, 10, (1,), False)
    assert "does not add the special prefix" in mismatch_message("http://h/v1", 9, 10, (1,), False)
    assert "another tokenizer" in mismatch_message("http://h/v1", 30, 10, (1,), False)
    assert "changed the token ids" in mismatch_message("http://h/v1", 11, 10, (1,), True)
    assert issubclass(TokenizerMismatchError, ValueError)


def test_urls_and_geometry():
    assert normalize_url("http://127.0.0.1:8000") == ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000")
    assert normalize_url("http://h:1/v1/") == ("http://h:1/v1", "http://h:1")
    with pytest.raises(InputError, match="not a server address"):
        normalize_url("127.0.0.1:8000")
    v4 = {"layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}}
    assert stride_from_config(v4) == 4
    assert stride_from_config({"compress_ratios": [0, 0, 4, 128, 4]}) == 4  # the released V4 config
    assert stride_from_config({"text_config": {"compress_ratios": [0, 0, *[2] * 18, *[1] * 20, 0, 0, 0]}}) == 2
    assert stride_from_config({"model_type": "llama"}) is None and stride_from_config(None) is None


def test_the_dispatcher_holds_shared_prefixes_behind_their_first_prompt():
    from phaselens.models.served.dispatch import dispatch, leaders

    base = np.arange(1000)
    other = np.r_[base[:10], base[10:] + 1]
    prompts = [base, base.copy(), other, np.r_[other[:500], base[500:]]]
    lead = leaders(prompts, min_shared=256)
    assert lead.tolist() == [0, 0, 2, 2]  # the third shares only 10 tokens with the second, the fourth 500
    order: list[int] = []
    out = dispatch(lambda i: order.append(i) or i * 10, 4, concurrency=4, lead=lead)
    assert out == [0, 10, 20, 30] and order.index(1) > order.index(0) and order.index(3) > order.index(2)
