"""How each kind of server is asked for one greedy answer, and how its reply is read.

A request asks for one new token at temperature 0 (greedy) after the item's prompt, with log-probabilities
where the server gives them. Four dialects, chosen by :func:`choose_dialect`:

* ``vllm``: ``POST /v1/completions`` with the prompt as a list of token ids, ``logprobs=K`` and vLLM's
  ``return_tokens_as_token_ids`` / ``return_token_ids``: the reply names the greedy token by id, echoes the
  prompt's ids, and gives the top-K log-probabilities (the answer's and distractor's where they are among them).
* ``sglang``: SGLang's native ``POST /generate`` with ``input_ids``, ``return_logprob`` and
  ``token_ids_logprob=[answer, wrong]``: the exact log-probabilities of both tokens, whatever their rank.
* ``openai-ids``: any other OpenAI-compatible server that takes a list of token ids as the completion prompt.
* ``openai-text``: a server that takes text only (``transformers serve``): the prompt is decoded to text and
  every reply's ``usage.prompt_tokens`` must equal the local tokenizer's count of the same prompt; the greedy
  token is read back from the reply's text.

The vLLM and SGLang formats follow their documented request and response models; phaselens' tests run the
``openai-text`` dialect against a real ``transformers serve`` (docs/served.md says which path ran where).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from phaselens.models.served.replies import refuse, validated

NAN = float("nan")


@dataclass(frozen=True)
class Reply:
    """One server reply, read: the greedy token (-1: no single local token), its and the answer's and the
    distractor's log-probabilities (NaN: not reported), the prompt length the server counted, the tokens it
    served from its prefix cache (``None``: not reported) and the prompt ids it echoed (``None``: none)."""

    predicted: int
    logp_predicted: float = NAN
    logp_answer: float = NAN
    logp_wrong: float = NAN
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    echoed: list[int] | None = None


@dataclass(frozen=True)
class Dialect:
    """One way of asking (see the module docstring): ``takes_ids`` says whether prompts go as token ids."""

    name: str
    top_logprobs: int = 20

    @property
    def takes_ids(self) -> bool:
        return self.name != "openai-text"

    @property
    def prompts(self) -> str:
        """How prompts travel, in words (results' metadata)."""
        return "token ids" if self.takes_ids else "text, each reply's usage.prompt_tokens checked against the local tokenizer"

    @property
    def logprobs(self) -> str:
        """What log-probabilities the dialect asks for, in words."""
        return {"vllm": f"top-{self.top_logprobs} log-probabilities of the greedy position (vLLM logprobs)",
                "sglang": "exact log-probabilities of the answer and distractor (SGLang token_ids_logprob)",
                }.get(self.name, f"top-{self.top_logprobs} log-probabilities where the server returns them")

    def request(self, model: str, ids: list[int], text: str | None, answer: int, wrong: int
                ) -> tuple[str, bool, dict[str, Any]]:
        """``(path, at_root, body)`` of the request for one prompt."""
        if self.name == "sglang":
            return "/generate", True, {
                "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "top_logprobs_num": self.top_logprobs,
                "token_ids_logprob": sorted({int(answer), int(wrong)}), "logprob_start_len": -1,
            }
        body: dict[str, Any] = {"model": model, "prompt": ids if self.takes_ids else text, "max_tokens": 1,
                                "temperature": 0.0}
        if self.top_logprobs:
            body["logprobs"] = self.top_logprobs
        if self.name == "vllm":
            body.update(return_tokens_as_token_ids=True, return_token_ids=True)
        return "/completions", False, body

    def read(self, data: Any, answer: int, wrong: int, vocab: Any, server: str = "the server") -> Reply:
        """The :class:`Reply` in a server's JSON answer, checked first against the dialect's schema
        (:mod:`phaselens.models.served.replies`): a reply that cannot be read exactly is a ``ServerError``
        naming the field, never a predicted id of -1."""
        data = validated(data, self.name, server)
        if self.name == "sglang":
            return _read_sglang(data, answer, wrong, server)
        return _read_completion(data, answer, wrong, vocab, dialect=self.name, server=server)


def _read_sglang(data: dict[str, Any], answer: int, wrong: int, server: str) -> Reply:
    meta = data["meta_info"]
    out = data.get("output_ids")
    entries = meta.get("output_token_logprobs")
    if not out and not entries:
        refuse(server, "sglang", "output_ids", "is missing, and so is meta_info.output_token_logprobs, so no token "
               "names the answer")
    predicted = out[0] if out else entries[0][1]
    if out and entries and entries[0][1] != predicted:
        refuse(server, "sglang", "meta_info.output_token_logprobs[0]",
               f"names token {entries[0][1]} where output_ids[0] is {predicted}")
    first = _num(entries[0][0]) if entries else NAN
    asked_rows = meta.get("output_token_ids_logprobs") or [None]
    asked = {e[1]: _num(e[0]) for e in asked_rows[0] or ()}
    return Reply(predicted, first, asked.get(int(answer), NAN), asked.get(int(wrong), NAN),
                 meta.get("prompt_tokens"), meta.get("cached_tokens"))


def _read_completion(data: dict[str, Any], answer: int, wrong: int, vocab: Any, *, dialect: str, server: str
                     ) -> Reply:
    choice = data["choices"][0]
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    top = (lp.get("top_logprobs") or [None])[0] or {}
    first = _num((lp.get("token_logprobs") or [None])[0])
    if dialect == "vllm":  # "token_id:123" keys, and the generated ids themselves
        at = "choices[0].logprobs"
        named = _token_id(tokens[0], f"{at}.tokens[0]", server) if tokens else None
        ids = choice.get("token_ids")
        if ids is None and named is None:
            refuse(server, dialect, "choices[0].token_ids", "is missing, and so is choices[0].logprobs.tokens, so "
                   "no token id names the answer (ask with return_token_ids)")
        predicted = ids[0] if ids is not None else named
        if named is not None and named != predicted:
            refuse(server, dialect, f"{at}.tokens[0]", f"names token {named} where choices[0].token_ids[0] is "
                   f"{predicted}")
        scores = {_token_id(k, f"{at}.top_logprobs[0][{k!r}]", server): float(v) for k, v in top.items()}
    else:  # tokens as text: read back through the local tokenizer
        text = tokens[0] if tokens else choice["text"]
        predicted = resolve_text(vocab, text, answer, wrong)
        scores = {resolve_text(vocab, k, answer, wrong): float(v) for k, v in top.items()}
    if predicted >= 0 and not math.isnan(first):
        scores[predicted] = first
    return Reply(predicted, first, scores.get(int(answer), NAN), scores.get(int(wrong), NAN),
                 usage.get("prompt_tokens"), cached, choice.get("prompt_token_ids"))


def resolve_text(vocab: Any, text: str, answer: int, wrong: int) -> int:
    """The token whose text a server returned: the answer or the distractor when it reads as theirs, else
    the one local token that encodes to exactly that text, else -1 (a partial character, an empty special)."""
    if not text:
        return -1
    for tid in (int(answer), int(wrong)):
        if vocab.decode([tid]) == text:
            return tid
    ids = vocab.encode(text)
    return int(ids[0]) if len(ids) == 1 and vocab.decode(ids) == text else -1


def _token_id(key: str, path: str, server: str) -> int:
    """The id in vLLM's ``"token_id:123"`` (``return_tokens_as_token_ids``); anything else is refused."""
    head, _, tail = str(key).partition(":")
    if head != "token_id" or not (tail.isascii() and tail.isdigit()):
        refuse(server, "vllm", path, f"is {key!r}, not 'token_id:N' (phaselens asks with return_tokens_as_token_ids)")
    return int(tail)


def _num(x: Any) -> float:
    """A validated log-probability (a number or null) as a float; null is NaN (not reported)."""
    return NAN if x is None else float(x)
