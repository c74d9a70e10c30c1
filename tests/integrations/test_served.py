"""Stratified generation through lm-eval's ``local-completions`` against a real ``transformers serve`` started here
(issue 47, item 2): text prompts with every ``usage.prompt_tokens`` checked, answers equal to lm-eval's ``hf`` model
on the same weights; loglikelihood refused; a tokenizer that counts differently refused. vLLM and SGLang take
token ids (``tokenized_requests``): checked where a CUDA GPU and the engine exist."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from phaselens.errors import NotApplicableError, TokenizerMismatchError
from phaselens.integrations.lm_eval import PHASE_KEY, PhaseCompletions, read_samples, stratify
from tests.support.lm_eval import bpe_tokenizer, evaluate, sharp_causal_lm, task_dir, write_checkpoint
from tests.support.serving import Server

S = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-lm-eval")
    model = sharp_causal_lm()
    checkpoint = write_checkpoint(root / "tiny-llama", model)
    server = Server(checkpoint)
    try:
        yield server.start(), checkpoint, model, task_dir(root / "tasks")
    finally:
        server.stop()


@pytest.mark.slow  # starts transformers serve (about 25 s on a loaded 2-core machine)
def test_stratified_generation_through_transformers_serve_equals_hf(served, tmp_path):
    from lm_eval.models.huggingface import HFLM

    server, checkpoint, model, tasks = served
    tok = bpe_tokenizer()
    gen = stratify(str(tasks / "tiny_gen.yaml"), tokenizer=tok, stride=S)
    local = evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=1), [gen])["samples"]["tiny_gen_phase4"]
    remote = PhaseCompletions(base_url=f"{server.url}/completions", model=str(checkpoint), tokenizer=str(checkpoint),
                              tokenized_requests=False, max_length=512)
    out = evaluate(remote, [stratify(str(tasks / "tiny_gen.yaml"), tokenizer=tok, stride=S)])
    served_samples = out["samples"]["tiny_gen_phase4"]
    assert len(served_samples) == 12 * S
    by_doc = {s["doc_id"]: s for s in served_samples}
    for s in local:  # the same text answer for every document at every shift
        assert by_doc[s["doc_id"]]["filtered_resps"][0] == s["filtered_resps"][0]
    assert len({s["filtered_resps"][0] for s in local}) > 4
    ev = read_samples(out, task="tiny_gen_phase4", n_permutations=200, n_bootstrap=100)
    assert sorted(ev.items["residue"].unique()) == [0, 1, 2, 3] and "accuracy alone" in ev.summary()
    assert all(s["doc"][PHASE_KEY]["slot"] == 1 + s["doc"][PHASE_KEY]["shift"] for s in served_samples)

    # loglikelihood needs prompt log-probabilities by token id: refused on a text-only server, before any request
    mc = stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=S)
    with pytest.raises(NotApplicableError, match=r"loglikelihood through a text-only server .* transformers serve"):
        evaluate(remote, [mc])

    # a local tokenizer without the BOS the server adds: every count is one more than the local one, refused
    from transformers import PreTrainedTokenizerFast

    from phaselens.tasks import train_toy_tokenizer

    bare = train_toy_tokenizer()
    from tokenizers import processors

    bare.post_processor = processors.TemplateProcessing(single="$A")
    PreTrainedTokenizerFast(tokenizer_object=bare, pad_token="<pad>", eos_token="<eos>").save_pretrained(tmp_path / "bare")
    wrong = PhaseCompletions(base_url=f"{server.url}/completions", model=str(checkpoint), tokenizer=str(tmp_path / "bare"),
                             tokenized_requests=False, max_length=512)
    with pytest.raises(TokenizerMismatchError, match=r"counted \d+ prompt tokens where the local tokenizer has \d+: it "
                                                     r"adds 1 token\(s\) of its own"):
        evaluate(wrong, [stratify(str(tasks / "tiny_gen.yaml"), tokenizer=tok, stride=S)])


def test_token_id_replies_are_counted_and_long_prompts_refused_before_any_request(tmp_path):
    """With token ids (vLLM, SGLang) every reply's usage.prompt_tokens must equal the ids sent (a server that
    changed them is refused), the BOS goes first as the tokenizer puts it, and a prompt that lm-eval would
    left-truncate is refused before anything is sent (no server runs here: nothing is requested)."""
    from lm_eval.api.instance import Instance

    from phaselens.errors import ContextLengthError, InputError, ServerError

    bpe_tokenizer().save_pretrained(tmp_path / "tok")
    lm = PhaseCompletions(base_url="http://127.0.0.1:9/v1/completions", model="m", tokenizer=str(tmp_path / "tok"),
                          max_length=64, max_gen_toks=8)
    ids = lm.tok_encode("Records: cat: Anna.", add_special_tokens=lm.add_bos_token)
    assert lm.add_bos_token and ids[0] == bpe_tokenizer().bos_token_id
    lm.check_usage({"usage": {"prompt_tokens": len(ids)}}, [ids])  # the ids sent: accepted
    lm.check_usage([{"usage": {"prompt_tokens": 3}}, {"usage": {"prompt_tokens": 4}}], [[1, 2, 3], [1, 2, 3, 4]])
    with pytest.raises(TokenizerMismatchError, match="it changed the token ids it was sent"):
        lm.check_usage({"usage": {"prompt_tokens": len(ids) + 1}}, [ids])
    long = "Records:" + " cat: Anna." * 40
    with pytest.raises(ContextLengthError, match="lm-eval would drop its first tokens"):
        lm.generate_until([Instance("generate_until", {}, (long, {"until": ["."]}), 0)])
    text = PhaseCompletions(base_url="http://127.0.0.1:9/v1/completions", model="m", tokenizer=str(tmp_path / "tok"),
                            tokenized_requests=False)
    with pytest.raises(ServerError, match="returned no usage.prompt_tokens"):
        text.check_usage({"choices": [{"text": "x"}]}, [[1, 2]])
    with pytest.raises(InputError, match="num_concurrent=1"):
        PhaseCompletions(base_url="http://127.0.0.1:9/v1/completions", model="m", tokenizer=str(tmp_path / "tok"),
                         tokenized_requests=False, num_concurrent=4)
    with pytest.raises(InputError, match="needs tokenizer=DIR"):
        PhaseCompletions(base_url="http://127.0.0.1:9/v1/completions", model="m")


needs_gpu_engine = pytest.mark.skipif(
    not torch.cuda.is_available() or not any(importlib.util.find_spec(e) for e in ("vllm", "sglang")),
    reason="vLLM and SGLang run on a CUDA GPU; this machine has none (or neither engine is installed)")


@needs_gpu_engine
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_stratified_multiple_choice_on_a_gpu_engine_equals_hf(engine, tmp_path):
    """lm-eval's own vllm / sglang model runs token ids (exact by construction): the stratified multiple-choice
    answers equal lm-eval's hf model on the same checkpoint."""
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed")
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    model = sharp_causal_lm()
    checkpoint = write_checkpoint(tmp_path / "tiny-llama", model)
    tasks = task_dir(tmp_path / "tasks")
    tok = bpe_tokenizer()
    local = evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=8),
                     [stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=S)])["samples"]["tiny_mc_phase4"]
    args = {"pretrained": str(checkpoint), "dtype": "float32"}
    if engine == "vllm":
        args["gpu_memory_utilization"] = 0.3
    else:
        args["mem_fraction_static"] = 0.3
    lm = get_model(engine)(**args)
    remote = evaluate(lm, [stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=S)])["samples"]["tiny_mc_phase4"]
    answer = {s["doc_id"]: max(range(3), key=lambda j: float(s["filtered_resps"][j][0])) for s in remote}
    assert [answer[s["doc_id"]] for s in local] == [max(range(3), key=lambda j: float(s["filtered_resps"][j][0]))
                                                    for s in local]
