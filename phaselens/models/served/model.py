"""A served model: an OpenAI-compatible endpoint behind phaselens' model contract, as a black box.

It answers prompts and nothing else: ``evaluate``, ``repair_table`` and padding probes run on its greedy
answers (and on the log-probabilities the server reports); analyses that need logits or hooks inside the
model refuse it in one line (``dims.black_box``).

Phases are exact or the run stops: prompts go as token ids where the server takes them, else as text whose
token count every reply confirms (:mod:`phaselens.models.served.protocols`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch

from phaselens.contract.answers import Answers
from phaselens.contract.dims import ModelDims, ModelIdentity
from phaselens.contract.memory import MemoryEstimate
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import NotApplicableError, TokenizerMismatchError
from phaselens.models.served.dispatch import dispatch, leaders
from phaselens.models.served.endpoint import InFlight
from phaselens.models.served.protocols import Dialect, Reply


class ServedModel:
    """A model behind an HTTP endpoint (vLLM, SGLang, ``transformers serve``); build it with
    ``phaselens.load("http://HOST:PORT/v1", model=NAME, tokenizer=PATH)``.

    Attributes:
        endpoint: the server's address and HTTP client (:class:`~phaselens.models.served.endpoint.Endpoint`).
        served_name: the model's name on the server (``/v1/models``).
        vocab: the tokenizer that makes the server's ids (:class:`~phaselens.models.served.vocabulary.Vocabulary`).
        dialect: how requests are asked (:class:`~phaselens.models.served.protocols.Dialect`).
        analysis_spec: the phase geometry (:class:`~phaselens.core.geometry.PhaseSpec`).
        concurrency: requests in flight at once.
        warm_prefix: hold a prompt back until the one it shares a long prefix with is answered (a
            prefix-caching server then prefills the shared part once).
        default_task: the task ``evaluate(model)`` uses when none is given (settable).
        progress: show the requests' progress bar (with prompt tokens/s).
    """

    def __init__(self, endpoint: Any, served_name: str, vocab: Any, dialect: Dialect, *, spec: PhaseSpec,
                 n_ctx: int = 0, concurrency: int = 8, warm_prefix: bool = True, default_task: Any = None,
                 progress: bool = True, checks: dict[str, Any] | None = None) -> None:
        self.endpoint, self.served_name, self.vocab, self.dialect = endpoint, served_name, vocab, dialect
        self.analysis_spec, self.n_ctx, self.concurrency = spec, int(n_ctx or 0), int(concurrency)
        self.warm_prefix, self.default_task, self.progress = bool(warm_prefix), default_task, bool(progress)
        self.checks = dict(checks or {})
        self._tokenizer_fp = vocab.fingerprint()

    # ---- the contract -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.served_name

    @property
    def tokenizer(self) -> Any:
        return self.vocab.tokenizer

    @property
    def dims(self) -> ModelDims:
        """No layers phaselens can see (``black_box``); the phase geometry, vocabulary and context are known."""
        return ModelDims(n_layers=0, n_heads=1, n_key_value_heads=1, d_head=1, d_vocab=self.vocab.size,
                         n_ctx=self.n_ctx, phase_specs=(), analysis_spec=self.analysis_spec, black_box=True)

    def identity(self) -> ModelIdentity:
        """The served model's name, the tokenizer's fingerprint and the geometry (not the address: a server
        restarted on another port is the same model, and a journal resumes on it)."""
        s = self.analysis_spec
        return ModelIdentity(type(self).__qualname__, {
            "served_model": self.served_name, "tokenizer": self._tokenizer_fp, "stride": s.stride,
            "window": s.window, "origin": s.origin, "top_logprobs": self.dialect.top_logprobs,
        }, None)

    @property
    def analysis_metadata(self) -> dict[str, Any]:
        """How the answers were obtained (``served``) and, as what runs observed, the address and the traffic."""
        return {
            "served": {"model": self.served_name, "protocol": self.dialect.name, "prompts": self.dialect.prompts,
                       "logprobs": self.dialect.logprobs, "tokenizer_sha256": self._tokenizer_fp,
                       "checks": dict(self.checks)},
            "served_endpoint": self.endpoint.api,
            "served_traffic": self.endpoint.traffic.as_dict(),
        }

    @property
    def returns_query_logits(self) -> bool:
        return False

    @property
    def hook_dict(self) -> dict[str, Any]:
        return {}

    def _refusal(self, what: str) -> NotApplicableError:
        return NotApplicableError(
            f"{what}: {self.served_name} is a served model at {self.endpoint.api}, which answers prompts but exposes "
            "no logits or hooks; run evaluate, repair_table or a PaddingProbe on it, or load the weights "
            "in-process (phaselens.load('hf:DIR')) for hook-based analyses."
        )

    def hooks(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
        raise self._refusal("hooks")

    def run_with_hooks(self, tokens: Any, *, fwd_hooks: Any = (), **kwargs: Any) -> Any:
        raise self._refusal("run_with_hooks")

    def __call__(self, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        raise self._refusal("a forward to logits")

    # ---- capabilities -------------------------------------------------------------------------------
    def estimate_memory(self, tokens: int, *, batch: int = 1, query_len: int | None = None, logits: str = "query",
                        chunk: int | None = None) -> MemoryEstimate:
        """Nothing on this machine: the forward runs on the server (the items' own memory is priced apart)."""
        return MemoryEstimate(int(tokens), int(batch), chunk, int(query_len or 1), 0, 0, 0, 0)

    def answer_queries(self, tokens: torch.Tensor, query_pos: torch.Tensor, answer: torch.Tensor,
                       wrong: torch.Tensor, *, progress: bool | None = None) -> Answers:
        """The greedy answer after each prompt ``tokens[i, :query_pos[i] + 1]`` (``tokens`` ``[N, T]``), with the
        log-probabilities the server reports, ``concurrency`` requests at a time.

        Raises :class:`~phaselens.errors.TokenizerMismatchError` when the server's tokens differ from the
        local ones and :class:`~phaselens.errors.ServerError` when it stops answering.
        """
        rows = tokens.cpu().numpy()
        ends = query_pos.cpu().numpy().astype(np.int64) + 1
        prompts = [rows[i, : ends[i]] for i in range(len(ends))]
        a, w = answer.cpu().numpy().astype(np.int64), wrong.cpu().numpy().astype(np.int64)
        lead = leaders(prompts) if self.warm_prefix else None
        t0, group = time.monotonic(), InFlight()
        try:
            replies = dispatch(lambda i: self._ask(prompts[i], int(a[i]), int(w[i]), group), len(prompts),
                               concurrency=self.concurrency, lead=lead,
                               progress=self.progress if progress is None else progress, stage="requests",
                               model=self, tokens=lambda r: r.prompt_tokens or 0)
        except BaseException:
            group.cancel()  # the first failure, or an interrupt, stops the requests still in flight
            raise
        finally:
            self.endpoint.traffic.seconds += time.monotonic() - t0
        return Answers(np.array([r.predicted for r in replies], np.int64),
                       *(np.array([getattr(r, f) for r in replies], np.float64)
                         for f in ("logp_answer", "logp_wrong", "logp_predicted")))

    def _ask(self, ids: np.ndarray, answer: int, wrong: int, group: InFlight | None = None) -> Reply:
        """One prompt, one reply, checked against the local tokens."""
        id_list = [int(i) for i in ids]
        text = None if self.dialect.takes_ids else self.prompt_text(id_list)
        path, root, body = self.dialect.request(self.served_name, id_list, text, answer, wrong)
        data = self.endpoint.json("POST", path, body, root=root, what="a completion request", group=group)
        reply = self.dialect.read(data, answer, wrong, self.vocab, server=f"the server at {self.endpoint.api}")
        self._check_reply(reply, id_list)
        self.endpoint.count(reply.prompt_tokens or len(id_list), reply.cached_tokens)
        return reply

    def prompt_text(self, ids: list[int]) -> str:
        """The text a text-only server gets for ``ids``: the ids after the tokenizer's own prefix (the server adds
        that prefix itself), decoded; refused unless encoding it back gives exactly ``ids``."""
        pre = list(self.vocab.prefix)
        body = ids[len(pre):] if ids[: len(pre)] == pre else ids
        text = self.vocab.decode(body)
        back = self.vocab.encode(text, special=True)
        if back != ids:
            at = next((k for k, (x, y) in enumerate(zip(back, ids)) if x != y), min(len(back), len(ids)))
            raise TokenizerMismatchError(
                f"a prompt of {len(ids)} tokens does not survive decoding to text and encoding back (first difference "
                f"at slot {at}: {ids[max(0, at - 2): at + 3]} became {back[max(0, at - 2): at + 3]}), and the server at "
                f"{self.endpoint.api} takes text only, so its phases would be wrong; serve the model with vLLM or "
                "SGLang (they take token ids), or use a task whose pieces tokenize alike in context."
            )
        return text

    def _check_reply(self, reply: Reply, ids: list[int]) -> None:
        counted = reply.prompt_tokens
        if reply.echoed is not None and list(reply.echoed) != ids:
            raise TokenizerMismatchError(
                f"the server at {self.endpoint.api} ran other prompt ids than phaselens sent ({len(reply.echoed)} ids "
                f"echoed for {len(ids)} sent); it changed the prompt (a chat template or an added BOS?).")
        if counted is None:  # an ids dialect (a text dialect's schema requires the count)
            return
        if counted != len(ids):
            raise TokenizerMismatchError(mismatch_message(self.endpoint.api, counted, len(ids), self.vocab.prefix,
                                                          self.dialect.takes_ids))

    # ---- connections and display --------------------------------------------------------------------
    def close(self) -> None:
        """Close the HTTP connections (the server keeps running)."""
        self.endpoint.close()

    def __enter__(self) -> ServedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        t = self.endpoint.traffic
        return (f"ServedModel({self.served_name!r} at {self.endpoint.api}, {self.dialect.name}: prompts as "
                f"{'token ids' if self.dialect.takes_ids else 'text'}, stride {self.analysis_spec.stride}, concurrency "
                f"{self.concurrency}; {t.requests} requests, {t.prompt_tokens:,} prompt tokens so far)")


def mismatch_message(url: str, counted: int, local: int, prefix: tuple[int, ...], takes_ids: bool) -> str:
    """What differs when a server counts ``counted`` prompt tokens where the local tokenizer has ``local``."""
    d = counted - local
    if takes_ids:
        why = "it changed the token ids it was sent (a chat template, or an added BOS)"
    elif d > 0 and d <= 8:
        why = (f"it adds {d} token(s) of its own: a BOS the local tokenizer does not add, or a chat template; serve "
               "the model without a chat template, or pass the tokenizer the server uses")
    elif d < 0 and -d <= len(prefix):
        why = "it does not add the special prefix (BOS) the local tokenizer adds: pass the tokenizer the server uses"
    else:
        why = "it tokenizes the text differently: another tokenizer; pass the served checkpoint's own tokenizer"
    return (f"the server at {url} counted {counted} prompt tokens where the local tokenizer has {local}: {why}. "
            "No answer is kept: its phases would be wrong.")
