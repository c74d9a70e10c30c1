"""``PhaseCompletions``: lm-eval's ``local-completions`` under phaselens' exactness rules (lm-eval's name:
``phaselens-completions``; docs/served.md has the rules for phaselens' own served model).

A phase is a token position, so the server must run exactly the ids the task was built for:

* **Token ids** (``tokenized_requests=True``, lm-eval's default; vLLM and SGLang take them): the local tokenizer
  makes the ids, with its special prefix (BOS) as lm-eval's ``hf`` model adds it (``add_bos_token`` defaults to
  whether the tokenizer has one), and every reply's ``usage.prompt_tokens`` must equal the ids sent.
* **Text** (``tokenized_requests=False``; ``transformers serve`` takes nothing else): generation only. Every
  reply's ``usage.prompt_tokens`` must equal the local tokenizer's count of the prompt with its special prefix
  (the server adds the prefix itself); a server that adds other tokens or tokenizes differently is a
  :class:`~phaselens.errors.TokenizerMismatchError`. A loglikelihood request is refused: it needs the
  prompt's log-probabilities by token (``echo``), which a text-only server does not return.
* Nothing is truncated: a request longer than ``max_length`` is refused (lm-eval would drop its first tokens,
  moving every other token to another slot).

Checking each reply needs the replies one by one, so text prompts run with ``num_concurrent=1`` (batches of
prompts still work where the server takes them).
"""

from __future__ import annotations

from typing import Any

from lm_eval.models.openai_completions import LocalCompletionsAPI

from phaselens.errors import (
    ContextLengthError,
    InputError,
    NotApplicableError,
    ServerError,
    TokenizerMismatchError,
)
from phaselens.integrations.lm_eval.tokens import TokenizerView
from phaselens.models.served.model import mismatch_message


class PhaseCompletions(LocalCompletionsAPI):
    """lm-eval's ``local-completions`` that refuses what would run at other phases (see the module docstring).

    Args:
        base_url: the server's completions endpoint, e.g. ``http://127.0.0.1:8000/v1/completions``.
        tokenizer: the served checkpoint's tokenizer (a local folder; required: phases are counted with it).
        tokenized_requests: send token ids (vLLM, SGLang) or text (``transformers serve``).
        add_bos_token: put the tokenizer's BOS before token-id prompts (default: when the tokenizer has one).
        kwargs: lm-eval's ``local-completions`` options (``model``, ``max_length``, ``max_gen_toks``, ...).
    """

    def __init__(self, base_url: str | None = None, tokenizer: str | None = None, tokenized_requests: bool = True,
                 add_bos_token: bool | None = None, num_concurrent: int = 1, **kwargs: Any) -> None:
        if not tokenizer:
            raise InputError("phaselens-completions needs tokenizer=DIR (the served checkpoint's tokenizer): phases "
                             "are counted in its tokens.")
        for name in ("tokenizer_backend",):
            if kwargs.pop(name, "huggingface") != "huggingface":
                raise InputError("phaselens-completions counts tokens with the local tokenizer "
                                 "(tokenizer_backend=huggingface).")
        tokenized = tokenized_requests is True or str(tokenized_requests).lower() in ("true", "1")
        if not tokenized and int(num_concurrent) > 1:
            raise InputError("text prompts are checked reply by reply (usage.prompt_tokens), which lm-eval's "
                             "concurrent requests do not expose: use num_concurrent=1 with tokenized_requests=False.")
        from transformers import AutoTokenizer

        local = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        view = TokenizerView(local)
        bos = bool(view.prefix) if add_bos_token is None else (add_bos_token is True or
                                                              str(add_bos_token).lower() in ("true", "1"))
        super().__init__(base_url=base_url, tokenizer=str(tokenizer), tokenizer_backend="huggingface",
                         tokenized_requests=tokenized, add_bos_token=bos, num_concurrent=num_concurrent, **kwargs)
        self.view = view

    # ---- what a text-only server cannot do ----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._refuse_scores("loglikelihood")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        self._refuse_scores("loglikelihood_rolling")
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def _refuse_scores(self, what: str) -> None:
        if not self.tokenized_requests:
            raise NotApplicableError(
                f"{what} through a text-only server ({self.base_url}): it needs the log-probability of every prompt "
                "token by id (echo), which a text-only server such as transformers serve does not return. Run the "
                "task's generation flavour (an exported task's <name>_gen, or a generate_until task), or serve the "
                "model with vLLM or SGLang and tokenized_requests=True.")

    # ---- no truncation -------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        for _, ctx, cont in requests:
            if len(ctx) + len(cont) > self.max_length:
                raise ContextLengthError(self._too_long(len(ctx) + len(cont)))
        return super()._loglikelihood_tokens(requests, **kwargs)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if self.tokenized_requests:
            for context, gen_kwargs in (req.args[:2] for req in requests):
                need = len(self.tok_encode(context, add_special_tokens=self.add_bos_token)) + \
                    int((gen_kwargs or {}).get("max_gen_toks", self._max_gen_toks))
                if need > self.max_length:
                    raise ContextLengthError(self._too_long(need))
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _too_long(self, n: int) -> str:
        return (f"a request of {n} tokens (with its generation budget) exceeds max_length={self.max_length}; lm-eval "
                "would drop its first tokens, moving every other token to another slot (another phase). Shorten the "
                "task, or pass a larger max_length if the server's context allows it.")

    # ---- every reply's token count (read where lm-eval parses the replies, outside its retries) -----------
    def parse_generations(self, outputs: Any, contexts: Any = None, **kwargs: Any) -> list[str]:  # type: ignore[override]
        if contexts is not None:
            self.check_usage(outputs, [self._sent(c) for c in contexts])
        elif not self.tokenized_requests:
            raise InputError("text prompts must be checked reply by reply: use num_concurrent=1.")
        return LocalCompletionsAPI.parse_generations(outputs=outputs, **kwargs)

    def parse_logprobs(self, outputs: Any, tokens: Any = None, ctxlens: Any = None, **kwargs: Any  # type: ignore[override]
                       ) -> list[tuple[float, bool]]:
        if tokens is not None:
            self.check_usage(outputs, [list(t) for t in tokens])
        return LocalCompletionsAPI.parse_logprobs(outputs=outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)

    def _sent(self, context: str) -> list[int]:
        """The ids the server runs for ``context``: those lm-eval sent, or (text) the local encoding with the
        special prefix the server adds."""
        if self.tokenized_requests:
            return list(self.tok_encode(context, add_special_tokens=self.add_bos_token))
        return self.view.encode(context, add_special_tokens=True)

    def check_usage(self, replies: Any, prompts: list[list[int]]) -> None:
        """The replies' ``usage.prompt_tokens`` (summed over a batch) against the prompts' local ids; a mismatch is
        a TokenizerMismatchError, a missing count on a text prompt a ServerError."""
        replies = replies if isinstance(replies, list) else [replies]
        counts = [((r or {}).get("usage") or {}).get("prompt_tokens") if isinstance(r, dict) else None for r in replies]
        local = sum(len(p) for p in prompts)
        if any(c is None for c in counts):
            if not self.tokenized_requests:
                raise ServerError(f"the server at {self.base_url} returned no usage.prompt_tokens, so the prompt's token "
                                  "count cannot be checked and its phases are unknown; use a server that reports usage "
                                  "or takes token ids (vLLM, SGLang).")
            return
        counted = sum(int(c) for c in counts)
        if counted != local:
            raise TokenizerMismatchError(mismatch_message(str(self.base_url), counted, local, self.view.prefix,
                                                          bool(self.tokenized_requests)))
