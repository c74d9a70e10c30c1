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

NAN = float("nan")
DIALECTS = ("vllm", "sglang", "openai-ids", "openai-text")


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

    def read(self, data: Any, answer: int, wrong: int, vocab: Any) -> Reply:
        """The :class:`Reply` in a server's JSON answer."""
        if self.name == "sglang":
            return _read_sglang(data, answer, wrong)
        return _read_completion(data, answer, wrong, vocab, by_id=self.name == "vllm")


def _read_sglang(data: Any, answer: int, wrong: int) -> Reply:
    if isinstance(data, list):  # a batch of one
        data = data[0]
    meta = data.get("meta_info") or {}
    out = data.get("output_ids") or []
    first = (meta.get("output_token_logprobs") or [[NAN, -1, None]])[0]
    predicted = int(out[0]) if out else int(first[1])
    asked = {int(e[1]): float(e[0]) for e in ((meta.get("output_token_ids_logprobs") or [[]])[0] or [])}
    return Reply(predicted, _num(first[0]), asked.get(int(answer), NAN), asked.get(int(wrong), NAN),
                 _int(meta.get("prompt_tokens")), _int(meta.get("cached_tokens")))


def _read_completion(data: Any, answer: int, wrong: int, vocab: Any, *, by_id: bool) -> Reply:
    choice = (data.get("choices") or [{}])[0]
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    top = ((lp.get("top_logprobs") or [None])[0]) or {}
    first = (lp.get("token_logprobs") or [NAN])[0]
    if by_id:  # vLLM: "token_id:123" keys, and the generated ids themselves
        ids = choice.get("token_ids") or []
        predicted = int(ids[0]) if ids else (_token_id(tokens[0]) if tokens else -1)
        scores = {_token_id(k): float(v) for k, v in top.items()}
    else:  # tokens as text: read back through the local tokenizer
        text = tokens[0] if tokens else choice.get("text", "")
        predicted = resolve_text(vocab, text, answer, wrong)
        scores = {resolve_text(vocab, k, answer, wrong): float(v) for k, v in top.items()}
    if predicted >= 0 and not math.isnan(_num(first)):
        scores[predicted] = _num(first)
    return Reply(predicted, _num(first), scores.get(int(answer), NAN), scores.get(int(wrong), NAN),
                 _int(usage.get("prompt_tokens")), _int(cached), choice.get("prompt_token_ids"))


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


def _token_id(key: str) -> int:
    text = str(key)
    return int(text.split(":", 1)[1]) if text.startswith("token_id:") else -1


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return NAN


def _int(x: Any) -> int | None:
    return None if x is None else int(x)
