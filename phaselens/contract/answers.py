"""What a black-box model's ``answer_queries`` capability returns: its greedy answer to every prompt, with the
log-probabilities it reports (a served endpoint gives some, or none)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Answers:
    """The answers to ``N`` prompts (one per item, or per item and shifted copy).

    Attributes:
        predicted: ``[N]`` int64, the greedy next token's id; -1 where the answer maps to no single token of
            the local tokenizer (a text-only server that returned a partial character). The item is right when
            it equals the task's answer.
        logp_answer, logp_wrong: ``[N]`` float64, log-probabilities of the answer and the distractor token at
            the query; NaN where the model did not report them.
        logp_predicted: ``[N]`` float64, log-probability of the greedy token (its confidence); NaN where not
            reported.
    """

    predicted: np.ndarray
    logp_answer: np.ndarray
    logp_wrong: np.ndarray
    logp_predicted: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.predicted)
        for name in ("logp_answer", "logp_wrong", "logp_predicted"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Answers: {name} has {len(getattr(self, name))} entries for {n} prompts.")

    def __len__(self) -> int:
        return len(self.predicted)

    @property
    def has_logprobs(self) -> bool:
        """Whether every answer and distractor log-probability is known."""
        return bool(np.isfinite(self.logp_answer).all() and np.isfinite(self.logp_wrong).all())

    @classmethod
    def concat(cls, parts: list[Answers]) -> Answers:
        """Several answer sets joined in order."""
        if not parts:
            return cls(np.zeros(0, np.int64), *(np.zeros(0) for _ in range(3)))
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                     ("predicted", "logp_answer", "logp_wrong", "logp_predicted")))
