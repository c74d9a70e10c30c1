"""The ``phaselens`` lm-eval model (issue 47, item 1): equal to lm-eval's ``hf`` model on the same transformers object
(loglikelihood, rolling, generation), right on every in-process model kind, registered by name, and refusing what
would move tokens or cannot be scored."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lm_eval.api.instance import Instance

import phaselens
from phaselens.errors import ContextLengthError, InputError
from phaselens.integrations.lm_eval import MODEL_NAMES, PhaseLensLM, register
from phaselens.models.word_tokenizer import word_tokenizer
from tests.support.causal_lm import tiny_causal_lm


def ll(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), 0)


def words(ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama in float64 (hf and phaselens batch differently; fp64 keeps the comparison exact on any CPU)."""
    return tiny_causal_lm("llama").double().eval()


def test_equal_to_lm_evals_hf_model_on_the_same_transformers_object(llama):
    from lm_eval.models.huggingface import HFLM

    tok = word_tokenizer(128, eos_id=2)
    hf = HFLM(pretrained=llama, tokenizer=tok, batch_size=3)
    ours = PhaseLensLM(model=llama, tokenizer=tok, stride=4, batch_size=3)
    reqs = [ll(f"t{5 + i} t{9 + i} t{11 + i}", c) for i in range(4) for c in (" t40", " t41 t42")] + [ll("", "t7 t8")]
    a, b = hf.loglikelihood(reqs, disable_tqdm=True), ours.loglikelihood(reqs, disable_tqdm=True)
    assert [x[1] for x in a] == [y[1] for y in b]
    assert [x[0] for x in a] == pytest.approx([y[0] for y in b], rel=1e-12, abs=1e-12)
    rolling = [Instance("loglikelihood_rolling", {}, (words((7 * j) % 128 for j in range(n)),), 0) for n in (3, 700)]
    assert hf.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        ours.loglikelihood_rolling(rolling, disable_tqdm=True), rel=1e-12)  # 700 tokens: two windows of 512
    # contexts that do not begin with "t1": lm-eval's hf model drops the BOS of a generation prompt whose *text*
    # begins with the BOS's text ("t12 ..." begins with "t1"; docs/lm_eval.md), phaselens compares ids
    gens = [Instance("generate_until", {}, (f"t{40 + i} t{9 + i}" + " t3" * (i % 3), {"until": ["t77"], "max_gen_toks": 6}),
                     0) for i in range(7)]
    hf1 = HFLM(pretrained=llama, tokenizer=tok, batch_size=1)  # hf left-pads generation batches
    assert hf1.generate_until(gens, disable_tqdm=True) == ours.generate_until(gens, disable_tqdm=True)


def _v41(tmp_path):
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    return phaselens.load(f"hf:{write_tiny_checkpoint(tmp_path / 'v41', tokenizer=False)}", dtype=torch.float64,
                          index_topk="all")


@pytest.mark.parametrize("kind", ["zoo", "causal_lm", "ensemble",  # the DeepSeek kinds: about 10 s each to build
                                  pytest.param("deepseek_v4", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v41", marks=pytest.mark.slow)])
def test_every_in_process_kind_scores_as_its_own_forward(kind, tmp_path):
    """On each kind, lm-eval's requests (batched, right-padded, shared prefixes deduplicated) score what one
    unbatched forward of the model gives: the log-probability of each continuation token, and greedy flags."""
    from tests.support.deepseek import tiny_v4_model

    builders = {"zoo": lambda: phaselens.load("zoo:w8s4"),
                "causal_lm": lambda: phaselens.load(tiny_causal_lm("qwen3").double(), stride=4),
                "deepseek_v4": lambda: phaselens.from_hf(tiny_v4_model().double()),
                "deepseek_v41": lambda: _v41(tmp_path),
                "ensemble": lambda: phaselens.phase_ensemble(phaselens.load("zoo:w4s4"), pad_id=100)}
    model = builders[kind]()
    vocab = int(model.dims.d_vocab)
    lm = PhaseLensLM(model=model, tokenizer=word_tokenizer(vocab), batch_size=4)
    g = torch.Generator().manual_seed(0)
    reqs = []
    for n in (5, 9, 9, 14):
        ctx = torch.randint(3, vocab, (n,), generator=g).tolist()
        for cont in ([int(torch.randint(3, vocab, (1,), generator=g))], torch.randint(3, vocab, (3,), generator=g).tolist()):
            reqs.append((ctx, cont))
    got = lm.loglikelihood([ll(words(c), " " + words(x)) for c, x in reqs], disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(reqs, got):
        ids = torch.tensor([[1, *ctx, *cont[:-1]]])
        with torch.no_grad():
            rows = model(ids, logits="query", query_len=len(cont)).double().log_softmax(-1)[0]
        want = rows[torch.arange(len(cont)), torch.tensor(cont)]
        # float64 end to end on a transformers causal LM; the other kinds compute in float32 (another batch shape)
        assert logp == pytest.approx(float(want.sum()), abs=1e-9 if kind == "causal_lm" else 1e-5)
        assert greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())
    # prompts of 5, 9, 9 and 14 tokens decoded in one right-padded batch, each as by hand alone
    prompts = [ctx for ctx, _ in reqs[::2]]
    out = lm.generate_until([Instance("generate_until", {}, (words(p), {"until": [], "max_gen_toks": 3}), 0)
                             for p in prompts], disable_tqdm=True)
    for prompt, text in zip(prompts, out):
        seq = torch.tensor([[1, *prompt]])
        for _ in range(3):
            with torch.no_grad():
                seq = torch.cat([seq, model(seq, logits="query", query_len=1)[:, -1:].argmax(-1)], 1)
        assert text == lm.tok_decode(seq[0, -3:].tolist())  # special tokens skipped, as lm-eval's hf model does


def test_lm_eval_finds_the_phaselens_models_by_name_and_keeps_its_own():
    from lm_eval.api.registry import get_model

    assert register() == list(MODEL_NAMES) == register()  # idempotent
    assert get_model("phaselens") is PhaseLensLM
    assert get_model("phaselens-completions").__name__ == "PhaseCompletions"
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still there


def test_requests_that_would_move_tokens_or_cannot_be_answered_are_refused():
    zoo = phaselens.load("zoo:w8s4")
    lm = PhaseLensLM(model=zoo)
    long = words([5] * 300)  # the zoo's context is 256 tokens
    with pytest.raises(ContextLengthError, match="does not truncate"):
        lm.loglikelihood([ll(long, " t6")], disable_tqdm=True)
    with pytest.raises(ContextLengthError, match="leaves no room"):
        lm.generate_until([Instance("generate_until", {}, (long, {"until": []}), 0)], disable_tqdm=True)
    with pytest.raises(InputError, match="decodes greedily"):
        lm.generate_until([Instance("generate_until", {}, ("t5", {"do_sample": True, "temperature": 0.7}), 0)])
    with pytest.raises(InputError, match="cannot encode 'hello t5'"):
        lm.loglikelihood([ll("hello", " t5")], disable_tqdm=True)
    bare = phaselens.models.CompressedTransformer(zoo.cfg)
    with pytest.raises(InputError, match="has no tokenizer for lm-eval's text: pass tokenizer=PATH"):
        PhaseLensLM(model=bare)
    with pytest.raises(InputError, match="model=..."):
        PhaseLensLM()
    with pytest.raises(InputError, match="used as it is"):
        PhaseLensLM(model=zoo, stride=4)


def test_without_lm_eval_phaselens_imports_and_says_what_to_install():
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "import phaselens, phaselens.integrations.lm_eval as le\n"
            "print(le.read_samples.__name__)\n"
            "try:\n    le.PhaseLensLM\nexcept phaselens.errors.MissingDependencyError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "read_samples" in out.stdout and 'refused: lm-evaluation-harness is not installed' in out.stdout
    assert 'pip install "lm-eval[hf,api]>=0.4.13,<0.5"' in out.stdout
