"""What a server's reply must hold before phaselens reads it: one small schema per dialect, one checker.

A reply that cannot be read exactly (no choice, no text, no token id, a token count that is not an integer, a
string where an object belongs, a log-probability above 0 ...) is a
:class:`~phaselens.errors.ServerError` that names the field, what it held and the dialect; it is never
turned into a predicted id of -1 and scored as a wrong answer. Only what phaselens reads is checked, so fields a
server adds (or leaves out, where phaselens does not need them) change nothing.

A schema is a tree of :class:`Spec` nodes: ``object`` (named fields, each required or optional), ``list``
(every item one spec, a minimum length), ``tuple`` (positional items, e.g. SGLang's ``[logprob, id, text]``),
``map`` (string keys, every value one spec) and the leaves ``int`` (with a minimum), ``logprob`` (a number
<= 0), ``string`` and ``any``. ``nullable`` lets a field hold JSON ``null``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

from phaselens.errors import ServerError

#: The dialects' names in messages (``protocol=`` names them in code).
LABELS = {
    "vllm": "vLLM completions with token ids",
    "sglang": "SGLang /generate",
    "openai-ids": "OpenAI completions with token-id prompts",
    "openai-text": "OpenAI completions with text prompts (transformers serve)",
    "models": "OpenAI model list (GET /v1/models)",
    "tokenize": "/tokenize (vLLM, SGLang)",
    "detokenize": "/detokenize (vLLM, SGLang)",
}
DIALECTS = ("vllm", "sglang", "openai-ids", "openai-text")  # the ones a reply is scored from
LOGPROB_SLACK = 1e-4  # a log-probability a hair above 0 is rounding (fp16 logits); more is not a probability


@dataclass(frozen=True)
class Spec:
    """One node of a reply's schema (see the module docstring). ``what`` says what the value means, for the
    error message."""

    kind: str
    fields: dict[str, tuple[Spec, bool]] = field(default_factory=dict)  # object: name -> (spec, required)
    items: Spec | None = None  # list: every item; map: every value
    positions: tuple[Spec, ...] = ()  # tuple: the first len(positions) items
    min_len: int = 0
    minimum: int | None = None
    nullable: bool = False
    what: str = ""


def obj(nullable: bool = False, what: str = "", **fields: tuple[Spec, bool]) -> Spec:
    return Spec("object", fields=fields, nullable=nullable, what=what)


def seq(items: Spec, *, min_len: int = 0, nullable: bool = False, what: str = "") -> Spec:
    return Spec("list", items=items, min_len=min_len, nullable=nullable, what=what)


def integer(minimum: int | None = 0, *, nullable: bool = False, what: str = "") -> Spec:
    return Spec("int", minimum=minimum, nullable=nullable, what=what)


ANY = Spec("any", nullable=True)
TEXT = Spec("string", what="a string")
TOKEN_ID = integer(0, what="a token id (an integer >= 0)")
LOGPROB = Spec("logprob", nullable=True, what="a log-probability (a number <= 0)")
ENTRY = Spec("tuple", positions=(LOGPROB, TOKEN_ID), min_len=2, what="[logprob, token id, text]")  # SGLang


def check(value: Any, spec: Spec, *, dialect: str, server: str = "the server", path: str = "the reply") -> Any:
    """``value`` unchanged when it matches ``spec``; else a :class:`ServerError` naming the first field that
    does not (``path``, e.g. ``choices[0].text``), what it held, and ``dialect``."""
    if value is None:
        if spec.nullable or spec.kind == "any":
            return value
        refuse(server, dialect, path, "is null", spec)
    kind = spec.kind
    if kind in ("object", "map"):
        if not isinstance(value, dict):
            refuse(server, dialect, path, f"is {_show(value)}, not an object", spec)
        for name, (sub, required) in spec.fields.items():  # an object's named fields (a map has none)
            where = name if path == "the reply" else f"{path}.{name}"
            if name not in value:
                if required:
                    refuse(server, dialect, where, "is missing", sub)
                continue
            check(value[name], sub, dialect=dialect, server=server, path=where)
        for key, item in value.items() if kind == "map" else ():  # a map's values, every one the same spec
            check(item, spec.items or ANY, dialect=dialect, server=server, path=f"{path}[{key!r}]")
    elif kind in ("list", "tuple"):
        if not isinstance(value, list):
            refuse(server, dialect, path, f"is {_show(value)}, not a list", spec)
        if len(value) < spec.min_len:
            refuse(server, dialect, path, "is an empty list" if not value else f"holds {len(value)} item(s)", spec)
        subs = spec.positions if kind == "tuple" else [spec.items] * len(value)
        if kind == "list" and spec.items is not None and spec.items.kind == "int" and _all_ids(value, spec.items):
            return value  # fast path: a 128K-token echo of plain ids
        for i, (item, sub) in enumerate(zip(value, subs)):
            if sub is not None:
                check(item, sub, dialect=dialect, server=server, path=f"{path}[{i}]")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            refuse(server, dialect, path, f"is {_show(value)}, not an integer", spec)
        if spec.minimum is not None and value < spec.minimum:
            refuse(server, dialect, path, f"is {value}, below {spec.minimum}", spec)
    elif kind == "logprob":
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            refuse(server, dialect, path, f"is {_show(value)}, not a number", spec)
        if value > LOGPROB_SLACK:
            refuse(server, dialect, path, f"is {value}, above 0 (a probability above 1)", spec)
    elif kind == "string":
        if not isinstance(value, str):
            refuse(server, dialect, path, f"is {_show(value)}, not a string", spec)
    return value


def refuse(server: str, dialect: str, path: str, problem: str, spec: Spec | None = None) -> NoReturn:
    """Raise the :class:`ServerError` of a reply phaselens cannot read exactly."""
    want = f" where {spec.what} belongs" if spec is not None and spec.what else ""
    label = LABELS.get(dialect, dialect)
    answer = dialect in DIALECTS
    fix = ("check that the server speaks this dialect and is a version docs/served.md names"
           + (", or pass protocol= to choose another dialect" if answer else ""))
    raise ServerError(f"{server} sent a reply phaselens cannot read exactly ({label}): {path} {problem}{want}. "
                      f"{'No answer is scored from it' if answer else 'Nothing is guessed from it'}; {fix}.")


def _all_ids(value: list, spec: Spec) -> bool:
    low = spec.minimum if spec.minimum is not None else -math.inf
    return all(type(v) is int and v >= low for v in value)


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


# ---- the dialects' schemas ------------------------------------------------------------------------------------
def _completion(dialect: str) -> Spec:
    """An OpenAI ``/v1/completions`` reply (vLLM's adds ``token_ids`` and ``prompt_token_ids``)."""
    by_id, counted = dialect == "vllm", dialect == "openai-text"  # a text dialect needs the prompt's count
    count = integer(0, what="the prompt's token count (an integer >= 0), which proves the prompt's phases")
    cached = obj(nullable=True, cached_tokens=(integer(0, nullable=True, what="a token count"), False))
    usage = obj(nullable=not counted, what="the token counts", prompt_tokens=(count, counted),
                prompt_tokens_details=(cached, False))
    top = Spec("map", items=Spec("logprob", what="a log-probability (a number <= 0)"), nullable=True)
    logprobs = obj(nullable=True, what="the log-probabilities",
                   tokens=(seq(TEXT, nullable=True, what="the generated tokens"), False),
                   token_logprobs=(seq(LOGPROB, nullable=True), False),
                   top_logprobs=(seq(top, nullable=True), False))
    choice = obj(
        what="a choice (an object)",
        # the text is what a text dialect reads; vLLM names the token by id and its text is not read
        text=(Spec("string", nullable=by_id, what="the generated text (a string)"), not by_id),
        token_ids=(seq(TOKEN_ID, min_len=1, nullable=True, what="the generated token's id"), False),
        prompt_token_ids=(seq(TOKEN_ID, nullable=True, what="the prompt's token ids"), False),
        logprobs=(logprobs, False),
    )
    return obj(what="a completion (a JSON object)",
               choices=(seq(choice, min_len=1, what="one choice (the request asked for one)"), True),
               usage=(usage, counted))


SGLANG = obj(
    what="a /generate answer (a JSON object)",
    output_ids=(seq(TOKEN_ID, min_len=1, what="the generated token's id"), False),
    meta_info=(obj(what="meta_info (an object)",
                   prompt_tokens=(integer(0, what="the prompt's token count (an integer >= 0)"), False),
                   cached_tokens=(integer(0, nullable=True, what="a token count"), False),
                   output_token_logprobs=(seq(ENTRY, min_len=1, nullable=True), False),
                   output_token_ids_logprobs=(seq(seq(ENTRY, nullable=True), nullable=True), False)), True),
)

SCHEMAS: dict[str, Spec] = {
    "vllm": _completion("vllm"),
    "openai-ids": _completion("openai-ids"),
    "openai-text": _completion("openai-text"),
    "sglang": SGLANG,
    "models": obj(what="a model list (a JSON object)", data=(seq(obj(
        what="a model card (an object)", id=(Spec("string", what="the model's name (a string)"), True),
        owned_by=(Spec("string", nullable=True), False),
        max_model_len=(integer(1, nullable=True, what="the context length (an integer >= 1)"), False),
    ), what="the served models (a list)"), True)),
    "tokenize": obj(what="a /tokenize answer (a JSON object)",
                    tokens=(seq(TOKEN_ID, what="the token ids"), False),
                    input_ids=(seq(TOKEN_ID, what="the token ids"), False)),
    "detokenize": obj(what="a /detokenize answer (a JSON object)",
                      prompt=(Spec("string", what="the text (a string)"), False),
                      text=(Spec("string", what="the text (a string)"), False)),
}


def validated(data: Any, dialect: str, server: str = "the server") -> Any:
    """``data`` checked against its dialect's schema (:data:`SCHEMAS`); SGLang's batch of one unwrapped."""
    if dialect == "sglang" and isinstance(data, list):
        if len(data) != 1:
            refuse(server, dialect, "the reply", f"is a list of {len(data)} answers, where one belongs")
        data = data[0]
    check(data, SCHEMAS[dialect], dialect=dialect, server=server)
    if dialect in ("vllm", "openai-ids", "openai-text") and len(data["choices"]) != 1:
        refuse(server, dialect, "choices", f"holds {len(data['choices'])} choices where the request asked for one")
    return data
