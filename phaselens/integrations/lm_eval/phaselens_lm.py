"""``PhaseLensLM``: any in-process phaselens model as an lm-eval model (lm-eval's name: ``phaselens``).

    lm_eval --model phaselens --model_args model=zoo:w8s4 ...           (through ``phaselens lm-eval run``)
    simple_evaluate(model=PhaseLensLM(model=phaselens.load("zoo:w8s4")), tasks=[...])

Text becomes ids with the model's tokenizer exactly as lm-eval's ``hf`` model does (the tokenizer's special
prefix, BOS, first; a context that already starts with it is not given a second), and the scores are read
from the model's own forward (the contract's ``model(tokens, logits="query", query_len=n)``), so on a
transformers causal LM the numbers are those of lm-eval's ``hf`` model on the same object.

Phases are positions, so nothing here moves a token: batches are right-padded (a causal model's earlier
positions never see the padding), generation batches hold prompts of one length, and a request longer than
the model's context is refused (:class:`~phaselens.errors.ContextLengthError`) instead of being
left-truncated, which would shift every remaining token to another slot.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from phaselens.analyses.scoring import model_logits
from phaselens.contract.protocol import is_black_box
from phaselens.errors import ContextLengthError, InputError, NotApplicableError
from phaselens.integrations.lm_eval.generation import GREEDY_ONLY, greedy_decode
from phaselens.integrations.lm_eval.tokens import TokenizerView, load_any_tokenizer


class PhaseLensLM(TemplateLM):
    """A phaselens model behind lm-eval's ``LM`` interface.

    Args:
        model: a source for :func:`phaselens.load` (``"zoo:w8s4"``, ``"hf:DIR"``, a saved model's directory),
            a phaselens model, or a model object ``load`` adapts (a transformers model: pass ``stride``).
            ``pretrained`` is another name for it (lm-eval's usual key).
        tokenizer: a path (``tokenizer.json`` or a folder) or a tokenizer object; default: the model's own
            (``model.tokenizer``: a checkpoint directory's, or the zoo's word-level one).
        stride: the stride a model without compression is analysed at (given to ``load``).
        batch_size: forwards per batch (lm-eval's ``auto`` takes 16).
        max_length: the longest sequence a forward may take (default: the model's context ``n_ctx``).
        max_gen_toks: the default generation budget of ``generate_until``.
        device: for a model loaded from a source (``"cpu"``, ``"cuda"``); a model object stays where it is.
        load_options: other keywords for :func:`phaselens.load` (``dtype``, ``window``, ...).
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, *, pretrained: Any = None, stride: int | None = None,
                 batch_size: int | str | None = 16, max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, device: str | None = None, **load_options: Any) -> None:
        super().__init__()
        self.phase_model = _load(model if model is not None else pretrained, stride=stride, device=device,
                                 options=load_options)
        if is_black_box(self.phase_model):
            raise NotApplicableError(
                f"{self.phase_model.name} is a served model: lm-eval reaches a server itself. Use lm-eval's "
                "local-completions, or phaselens-completions for phaselens' exactness checks (docs/lm_eval.md).")
        tok = load_any_tokenizer(tokenizer) if tokenizer is not None else _model_tokenizer(self.phase_model)
        self.tokens = TokenizerView(tok)
        self.tokenizer = tok  # lm-eval reads lm.tokenizer (chat templates, names)
        n_ctx = int(self.phase_model.dims.n_ctx)
        self.max_length = n_ctx if max_length is None else _positive("max_length", max_length)
        if self.max_length > n_ctx:
            raise InputError(f"max_length={self.max_length} exceeds the model's context n_ctx={n_ctx}.")
        self.batch_size = 16 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else \
            _positive("batch_size", batch_size)
        self.max_gen_toks = _positive("max_gen_toks", max_gen_toks)
        dev = self.phase_model.dims.device
        self._device = torch.device(dev) if dev is not None else torch.device("cpu")

    # ---- what lm-eval reads ---------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is scored after: the BOS, else the end-of-text token."""
        pid = self.tokens.prefix[0] if self.tokens.prefix else self.tokens.eos_id
        if pid is None:
            raise InputError(f"the tokenizer {self.tokens.name} has neither a BOS nor an end-of-text token, so a request "
                             "with an empty context has nothing to be scored after; give the task a context.")
        return int(pid)

    @property
    def tokenizer_name(self) -> str:
        return self.tokens.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Ids of ``string``: with the tokenizer's special prefix unless ``add_special_tokens`` is False, or (when it
        is None) the text already begins with that prefix."""
        return self.tokens.encode(string, add_special_tokens)

    def tok_decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokens.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- scoring -----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """``(log-probability, greedy)`` of each continuation: ``requests`` are ``(key, context ids, continuation
        ids)``; the input is ``context + continuation[:-1]``, scored at its last ``len(continuation)`` rows."""
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        out = self._score(pairs, desc="phaselens loglikelihood", disable=disable_tqdm)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def _score(self, pairs: list[tuple[list[int], list[int]]], *, desc: str, disable: bool
               ) -> list[tuple[float, bool]]:
        for ctx, cont in pairs:
            if not ctx or not cont:
                raise InputError("a loglikelihood request needs a context and a continuation of at least one token.")
            if len(ctx) + len(cont) - 1 > self.max_length:
                raise ContextLengthError(
                    f"a request of {len(ctx)} context and {len(cont)} continuation tokens needs a forward of "
                    f"{len(ctx) + len(cont) - 1} tokens, more than max_length={self.max_length}; phaselens does not "
                    "truncate (it would move every token to another slot, another phase): shorten the task.")
        # requests whose inputs are equal share one forward (multiple choice with one-token choices)
        inputs: dict[tuple[int, ...], int] = {}
        for ctx, cont in pairs:
            inputs.setdefault(tuple(ctx + cont[:-1]), max(len(cont), 0))
        for ctx, cont in pairs:
            key = tuple(ctx + cont[:-1])
            inputs[key] = max(inputs[key], len(cont))
        order = sorted(inputs, key=len, reverse=True)
        logps: dict[tuple[int, ...], torch.Tensor] = {}
        bar = tqdm(total=len(order), desc=desc, disable=disable)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for key, rows in zip(chunk, self._rows(chunk, [inputs[k] for k in chunk])):
                logps[key] = rows
            bar.update(len(chunk))
        bar.close()
        out = []
        for ctx, cont in pairs:
            rows = logps[tuple(ctx + cont[:-1])][-len(cont):]  # [len(cont), vocab]
            target = torch.tensor(cont)
            out.append((float(rows[torch.arange(len(cont)), target].sum()), bool((rows.argmax(-1) == target).all())))
        return out

    @torch.no_grad()
    def _rows(self, inputs: list[tuple[int, ...]], keep: list[int]) -> list[torch.Tensor]:
        """Log-probabilities ``[keep_i, vocab]`` of the last ``keep_i`` rows of each input (one right-padded
        forward; only the rows needed are unembedded)."""
        lengths = torch.tensor([len(x) for x in inputs])
        t = int(lengths.max())
        tokens = torch.full((len(inputs), t), self.tokens.pad_id, dtype=torch.long)
        for i, x in enumerate(inputs):
            tokens[i, :len(x)] = torch.tensor(x)
        first = lengths - torch.tensor(keep)  # the earliest row each input needs
        logits = model_logits(self.phase_model, tokens.to(self._device), first.to(self._device))
        offset = t - logits.shape[1]
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1).cpu()
        return [logp[i, int(first[i]) - offset:int(lengths[i]) - offset] for i in range(len(inputs))]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, in windows of ``max_length`` tokens (as lm-eval's ``hf`` model)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            spans = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                              max_seq_len=self.max_length, context_len=1)
            for ctx, cont in map(make_disjoint_window, spans):
                windows.append((list(ctx), list(cont)))
                owner.append(i)
        scores = self._score(windows, desc="phaselens loglikelihood_rolling", disable=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (lm-eval's ``until``, plus the end-of-text token's
        text). Sampling is refused: phaselens scores what the model answers."""
        eos = self.tokens.decode([self.tokens.eos_id], skip_special_tokens=False) if self.tokens.eos_id is not None \
            else None
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise InputError(f"{GREEDY_ONLY} (got do_sample={kwargs.get('do_sample')}, temperature="
                                 f"{kwargs.get('temperature')}).")
            stops = handle_stop_sequences(kwargs.get("until"), eos=eos)
            budget = _positive("max_gen_toks", kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)
            if len(ids) >= self.max_length:
                raise ContextLengthError(
                    f"a generation prompt of {len(ids)} tokens leaves no room in max_length={self.max_length}; phaselens "
                    "does not truncate (it would move every token to another slot): shorten the task.")
            jobs.append((ids, stops, min(budget, self.max_length - len(ids))))
        texts = greedy_decode(self.phase_model, self.tokens, jobs, batch_size=self.batch_size, device=self._device,
                              disable=disable_tqdm)
        out = []
        for req, (_, stops, _), text in zip(requests, jobs, texts):
            answer = postprocess_generated_text(generation=text, stop=stops, think_end_token=None)
            self.cache_hook.add_partial("generate_until", req.args, answer)
            out.append(answer)
        return out


def _load(source: Any, *, stride: int | None, device: str | None, options: dict[str, Any]) -> Any:
    from phaselens.contract.adapting import is_phase_model
    from phaselens.models.sources import load

    if source is None:
        raise InputError("the phaselens lm-eval model needs model=... (e.g. --model_args model=zoo:w8s4, or "
                         "PhaseLensLM(model=phaselens.load('zoo:w8s4'))).")
    if is_phase_model(source):
        if stride is not None or options or device is not None:
            raise InputError("a phaselens model object is used as it is: stride, device and load options apply to a "
                             "source loaded here (a name, a path, or a transformers model).")
        return source
    if isinstance(source, str):
        kwargs = dict(options)
        if stride is not None:
            kwargs["stride"] = int(stride)
        return load(source, device=_device(device), **kwargs)
    if device is not None:
        raise InputError("device applies to a model loaded from a name or path; move a model object yourself.")
    return load(source, stride=None if stride is None else int(stride), **options)


def _device(device: str | None) -> str:
    """The device to load on: lm-eval's command line passes ``cuda:0`` unless told otherwise, so a machine without
    CUDA runs on the CPU, as lm-eval's own ``hf`` model does (said in the log)."""
    if device is None:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning("device=%s, but torch sees no CUDA GPU: the phaselens model runs on the CPU.",
                                            device)
        return "cpu"
    return str(device)


def _model_tokenizer(model: Any) -> Any:
    try:
        return model.tokenizer
    except (InputError, AttributeError):
        raise InputError(f"{model.name} has no tokenizer for lm-eval's text: pass tokenizer=PATH (a tokenizer.json or "
                         "its folder) in --model_args, or set model.tokenizer.") from None


def _positive(name: str, value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a positive integer, got {value!r}.") from None
    if isinstance(value, bool) or n < 1 or n != float(value):
        raise InputError(f"{name} must be a positive integer, got {value!r}.")
    return n
