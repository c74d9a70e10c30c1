"""Phase-stratified variants of lm-eval tasks (issue 47, item 2): a small multiple-choice and a small generation
task in lm-eval's own format (tests/data/lm_eval) on a tiny causal LM, through lm-eval's ``hf`` model and through
``phaselens``: equal per-sample answers, exact residues (the first context token at the recorded slot, seen in
the very ids the model ran), the battery read back, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import NotApplicableError, PaddingError, ResidueError
from phaselens.integrations.lm_eval import PHASE_KEY, PhaseLensLM, read_samples, stratify, write_stratified
from tests.support.lm_eval import bpe_tokenizer, evaluate, sharp_causal_lm, task_dir

S = 4


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return task_dir(tmp_path_factory.mktemp("lm-eval-tasks"))


@pytest.fixture(scope="module")
def lm():
    return sharp_causal_lm()


class Inputs:
    """Every row of input ids the transformers model ran (a hook on its embedding), padding stripped."""

    def __init__(self, model: torch.nn.Module, pad: int) -> None:
        self.rows: list[tuple[int, ...]] = []
        self.pad = pad
        self.handle = model.get_input_embeddings().register_forward_hook(self._record)

    def _record(self, module, args, output):
        for row in args[0].tolist():
            self.rows.append(tuple(row))

    def saw(self, ids: list[int]) -> bool:
        """Whether some forward's row begins with ``ids`` (at slot 0: no left padding moved it)."""
        n = len(ids)
        return any(row[:n] == tuple(ids) for row in self.rows)

    def close(self) -> None:
        self.handle.remove()


@pytest.fixture(scope="module")
def runs(lm, tasks):
    """The stratified tasks through lm-eval's hf model and through phaselens, on one transformers object, with the
    rows each ran. hf left-pads generation batches, so its generation runs one prompt per batch."""
    from lm_eval.models.huggingface import HFLM

    tok = bpe_tokenizer()
    mc = stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=S)
    gen = stratify(str(tasks / "tiny_gen.yaml"), tokenizer=tok, stride=S)
    assert (mc.task_name, gen.task_name) == ("tiny_mc_phase4", "tiny_gen_phase4")
    out = {}
    for name, make in (("hf", lambda batch: HFLM(pretrained=lm, tokenizer=tok, batch_size=batch)),
                       ("phaselens", lambda batch: PhaseLensLM(model=lm, tokenizer=tok, stride=S, batch_size=8))):
        for task, batch in ((mc, 8), (gen, 1)):
            seen = Inputs(lm, tok.pad_token_id)
            try:
                result = evaluate(make(batch), [task])
            finally:
                seen.close()
            out[name, task.task_name] = (sorted(result["samples"][task.task_name], key=lambda s: s["doc_id"]), seen,
                                         result)
    return out


def check_slots(samples, inputs: Inputs, tok) -> None:
    """Each sample's first context token sits at its recorded slot in ids the model ran: BOS, then ``shift``
    filler tokens, then the unshifted context's tokens."""
    for s in samples:
        meta = s["doc"][PHASE_KEY]
        k, slot = meta["shift"], meta["slot"]
        prompt = s["arguments"][0][0]
        base = prompt[len(meta["filler"]) * k:]
        ids, base_ids = tok(prompt)["input_ids"], tok(base)["input_ids"]
        assert ids[:1] == [tok.bos_token_id] and ids[1:slot] == [meta["filler_id"]] * k
        assert ids[slot:] == base_ids[1:] and slot == 1 + k  # the first context token, at the slot recorded
        assert meta["residue"] == slot % S and meta["phase"] == slot % S
        assert inputs.saw(ids), f"no forward ran the ids of document {s['doc_id']} from slot 0"


@pytest.mark.parametrize("backend", ["hf", "phaselens"])
@pytest.mark.parametrize("task", ["tiny_mc_phase4", "tiny_gen_phase4"])
def test_every_document_at_every_shift_with_exact_residues(runs, task, backend):
    samples, seen, _ = runs[backend, task]
    assert len(samples) == 12 * S
    # every document at every shift, in the plain task's order: doc i, shifts 0..S-1
    assert [(s["doc"]["id"], s["doc"][PHASE_KEY]["shift"]) for s in samples] == [(i, k) for i in range(12)
                                                                                  for k in range(S)]
    check_slots(samples, seen, bpe_tokenizer())


def test_multiple_choice_answers_are_equal_on_hf_and_phaselens(runs):
    a, b = (runs[name, "tiny_mc_phase4"][0] for name in ("hf", "phaselens"))
    lla = np.array([[float(c[0]) for c in s["filtered_resps"]] for s in a])
    llb = np.array([[float(c[0]) for c in s["filtered_resps"]] for s in b])
    np.testing.assert_allclose(lla, llb, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(lla.argmax(1), llb.argmax(1))  # the same answer, sample by sample
    assert [s["acc"] for s in a] == [s["acc"] for s in b]
    assert len(set(lla.argmax(1).tolist())) > 1  # the model does not answer everything alike


def test_generated_answers_are_equal_on_hf_and_phaselens(runs):
    a, b = (runs[name, "tiny_gen_phase4"][0] for name in ("hf", "phaselens"))
    assert [s["filtered_resps"][0] for s in a] == [s["filtered_resps"][0] for s in b]
    assert len({s["filtered_resps"][0] for s in a}) > 4
    # the shifts change what this model answers: phases matter to it
    assert any(len({a[S * i + k]["filtered_resps"][0] for k in range(S)}) > 1 for i in range(12))


def test_the_unshifted_variant_is_the_plain_task_and_the_battery_reads_back(runs, lm, tasks):
    tok = bpe_tokenizer()
    plain = evaluate(PhaseLensLM(model=lm, tokenizer=tok, stride=S), [str(tasks / "tiny_mc.yaml")])
    samples, _, result = runs["phaselens", "tiny_mc_phase4"]
    first = [s for s in samples if s["doc"][PHASE_KEY]["shift"] == 0]
    assert [s["arguments"] for s in first] == [s["arguments"] for s in sorted(plain["samples"]["tiny_mc"],
                                                                              key=lambda s: s["doc_id"])]
    ev = read_samples(result, task="tiny_mc_phase4", n_permutations=200, n_bootstrap=100)
    assert len(ev.items) == 12 * S and sorted(ev.items["residue"].unique()) == [0, 1, 2, 3]
    assert ev.tests.design == "paired" and np.isfinite(ev.items["nll"]).all()
    assert ev.mean == pytest.approx(np.mean([s["acc"] for s in samples]))
    # nll is the gold choice's, logit_diff gold minus the best other choice
    lls = np.array([[float(c[0]) for c in s["filtered_resps"]] for s in samples])
    label = np.array([s["doc"]["label"] for s in samples])
    want = lls[np.arange(len(lls)), label]
    np.testing.assert_allclose(ev.items["nll"].to_numpy(), -want, rtol=1e-12)
    other = np.where(np.arange(3)[None] == label[:, None], -np.inf, lls).max(1)
    np.testing.assert_allclose(ev.items["logit_diff"].to_numpy(), want - other, rtol=1e-12)
    gen_samples, _, gen_result = runs["phaselens", "tiny_gen_phase4"]
    gev = read_samples(gen_result, task="tiny_gen_phase4", n_permutations=200, n_bootstrap=100)
    assert gev.mean == pytest.approx(np.mean([s["exact_match"] for s in gen_samples]))


def test_the_yaml_route_runs_the_same_stratified_task(lm, tasks, tmp_path):
    """``write_stratified`` writes a YAML lm-eval loads from --include_path (its ``class`` is phaselens'); the
    filler 'auto' chose is written down, and the task's samples equal the Python route's."""
    tok_dir = tmp_path / "tok"
    bpe_tokenizer().save_pretrained(tok_dir)
    path = write_stratified(str(tasks / "tiny_mc.yaml"), tmp_path / "strat", tokenizer=tok_dir, stride=S,
                            name="tiny_mc_strat")
    text = path.read_text()
    assert "class: !function phaselens.integrations.lm_eval.stratification.StratifiedTask" in text and 'filler: " ."' in text
    model = PhaseLensLM(model=lm, tokenizer=bpe_tokenizer(), stride=S)
    by_yaml = evaluate(model, ["tiny_mc_strat"], include=path.parent)["samples"]["tiny_mc_strat"]
    by_python = evaluate(model, [stratify(str(tasks / "tiny_mc.yaml"), tokenizer=bpe_tokenizer(), stride=S)])
    assert [s["arguments"] for s in by_yaml] == [s["arguments"] for s in by_python["samples"]["tiny_mc_phase4"]]
    assert [s["doc"][PHASE_KEY]["residue"] for s in by_yaml] == [(1 + k) % S for _ in range(12) for k in range(S)]


def test_zoo_stratified_with_its_word_filler(tmp_path):
    """The zoo's word-level tokenizer takes a word as filler ("t100 "); the auto choice finds none among the
    punctuation candidates and says so, naming the tokenizer."""
    import json

    data = tmp_path / "kv.jsonl"
    data.write_text("".join(json.dumps({"context": f"t{3 + i} t{51 + i} t2 t{3 + i}", "choices": [f" t{51 + i}", " t60"],
                                        "label": 0}) + "\n" for i in range(3)))
    (tmp_path / "kv.yaml").write_text(f"task: zoo_kv\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                                      f"{data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: context\n"
                                      "doc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ''\n")
    with pytest.raises(PaddingError, match=r"no filler pads .* tokenizer TokenizersBackend of 128 tokens; tried ' \.'"):
        stratify(str(tmp_path / "kv.yaml"), tokenizer="zoo:w8s4", stride=4)
    task = stratify(str(tmp_path / "kv.yaml"), tokenizer="zoo:w8s4", stride=4, modulus=8, filler="t100 ")
    out = evaluate(PhaseLensLM(model=phaselens.load("zoo:w8s4")), [task])
    samples = out["samples"]["zoo_kv_phase4"]
    assert len(samples) == 3 * 8 and {s["doc"][PHASE_KEY]["residue"] for s in samples} == set(range(8))
    assert samples[3]["arguments"][0][0] == "t100 " * 3 + "t3 t51 t2 t3"


def test_a_filler_that_cannot_be_token_exact_is_refused(tasks):
    """'=' merges with itself in the BPE ('==' is a merge), ' Records' is two tokens: each is refused with a
    PaddingError naming the tokenizer and the filler, before any request is built."""
    tok = bpe_tokenizer()
    for filler, why in (("=", r"merges at the inner seam"), (" Records", r"is 2 tokens")):
        with pytest.raises(PaddingError) as err:
            stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=S, filler=filler)
        message = str(err.value)
        assert f"the filler {filler!r}" in message and "tokenizer TokenizersBackend of" in message
        assert __import__("re").search(why, message)


def test_a_filler_that_merges_with_a_context_is_refused(tasks, tmp_path):
    """' =' is one token alone and three times, but merges with a context that begins with '= ' (' ==' is one
    token of the BPE): stratifying a task with such contexts is refused, naming the filler, the tokenizer, the
    shift's ids and the slot; the same filler pads the lookup task exactly."""
    import json

    tok = bpe_tokenizer()
    data = tmp_path / "eq.jsonl"
    data.write_text("".join(json.dumps({"context": f"= x{i}", "choices": [" a", " b"], "label": 0}) + "\n"
                            for i in range(3)))
    (tmp_path / "eq.yaml").write_text(f"task: eq\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                                      "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\n"
                                      "doc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ''\n")
    with pytest.raises(PaddingError, match=r"the filler ' =' does not pad this context token-exactly with the "
                                           r"tokenizer TokenizersBackend of \d+ tokens: 1 unit\(s\) in front of '= x0'"):
        stratify(str(tmp_path / "eq.yaml"), tokenizer=tok, stride=S, filler=" =")
    assert stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=S, filler=" =").task_name == "tiny_mc_phase4"


def test_stratification_refusals(tasks, tmp_path):
    tok = bpe_tokenizer()
    with pytest.raises(ResidueError, match="modulus=6 is not a multiple of stride=4"):
        stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=4, modulus=6)
    rolling = tmp_path / "ppl.yaml"
    (tmp_path / "ppl.jsonl").write_text('{"text": "Records: cat: Anna."}\n')
    rolling.write_text(f"task: ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'ppl.jsonl'}\n"
                       "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: text\n")
    with pytest.raises(NotApplicableError, match="perplexity task"):
        stratify(str(rolling), tokenizer=tok, stride=4)
    strat = stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=4)
    with pytest.raises(NotApplicableError, match="chat template"):
        strat.fewshot_context(strat.eval_docs[0], num_fewshot=0, apply_chat_template=True)
