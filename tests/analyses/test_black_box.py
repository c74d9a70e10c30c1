"""Scoring a black-box model from its answers (no server needed): the metrics and the repair rules a served
model gets equal the in-process ones computed from full logits, wherever the answers determine them."""

from __future__ import annotations

import numpy as np
import torch

from phaselens.analyses.scoring import METRICS, answer_metrics, black_box_metrics
from phaselens.contract.answers import Answers
from phaselens.repair.shifts import combine
from phaselens.repair.table import black_box_rule


def answers_of(logits: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor) -> Answers:
    """What a server that reports exact log-probabilities (SGLang's token_ids_logprob) returns."""
    logp = logits.float().log_softmax(-1)
    rows = torch.arange(len(answer))
    pred = logits.argmax(-1)
    return Answers(pred.numpy(), logp[rows, answer].double().numpy(), logp[rows, wrong].double().numpy(),
                   logp[rows, pred].double().numpy())


def test_black_box_metrics_equal_the_logit_metrics():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    answer, wrong = torch.randint(0, 50, (64,), generator=g), torch.randint(0, 50, (64,), generator=g)
    answer[::3] = logits.argmax(-1)[::3]  # some right
    ref = answer_metrics(logits, answer, wrong)
    got = black_box_metrics(answers_of(logits, answer, wrong), answer)
    assert set(got) == set(METRICS) and ref["correct"].any() and not ref["correct"].all()
    assert np.array_equal(got["correct"], ref["correct"]) and np.array_equal(got["predicted"], ref["predicted"])
    for k in ("p_correct", "p_wrong", "logit_diff", "nll"):
        assert np.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6), k
    assert np.array_equal(got["rank"] == 0, ref["rank"] == 0) and np.isnan(got["rank"][~ref["correct"]]).all()


def test_without_log_probabilities_only_accuracy_is_known():
    ans = Answers(np.array([3, 4]), np.full(2, np.nan), np.full(2, np.nan), np.full(2, np.nan))
    got = black_box_metrics(ans, torch.tensor([3, 5]))
    assert got["correct"].tolist() == [True, False] and np.isnan(got["nll"]).all() and not ans.has_logprobs


def test_max_conf_and_vote_equal_the_in_process_rules():
    g = torch.Generator().manual_seed(1)
    K, B, V = 4, 200, 12
    per_copy = torch.randn(K, B, V, generator=g) * 2
    answer, wrong = torch.randint(0, V, (B,), generator=g), torch.randint(0, V, (B,), generator=g)
    copies = [answers_of(per_copy[k], answer, wrong) for k in range(K)]
    ref = answer_metrics(combine(per_copy, "max_conf")[0], answer, wrong)
    got = black_box_rule(copies, answer, wrong, "max_conf")
    assert np.array_equal(got["predicted"], ref["predicted"]) and np.array_equal(got["correct"], ref["correct"])
    assert np.allclose(got["logit_diff"], ref["logit_diff"], atol=1e-5)

    ref = answer_metrics(combine(per_copy, "vote")[0], answer, wrong)
    got = black_box_rule(copies, answer, wrong, "vote")
    votes = torch.nn.functional.one_hot(per_copy.argmax(-1), V).sum(0)  # [B, V]
    top2 = votes.sort(-1, descending=True).values[:, :2]
    strict = (top2[:, 0] > top2[:, 1]).numpy()  # no tie: the vote alone decides
    assert 0.3 < strict.mean() < 1
    assert np.array_equal(got["predicted"][strict], ref["predicted"][strict])
    assert np.allclose(got["p_correct"], ref["p_correct"], rtol=1e-4)  # the rule's probabilities, every item
    assert np.allclose(got["logit_diff"], ref["logit_diff"], atol=1e-4)
