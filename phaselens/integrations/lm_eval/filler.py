"""The filler of phase stratification: a text unit that is exactly one token of the model's tokenizer, alone,
repeated, and in front of every context it pads.

Stratifying shifts a context by ``k`` units of prefix padding. That moves every context token by exactly ``k``
slots only if ``encode(filler * k + context)`` is ``[unit] * k + encode(context)``: the unit is one token, it
does not merge with itself, and it does not merge with the context's first characters (a byte-level BPE reads
``" . Question"`` differently from ``"Question"``). :func:`check_shift` checks exactly that, on each context
at each shift; :func:`choose_filler` picks the first candidate that passes. A filler that cannot be made exact
is refused with a :class:`~phaselens.errors.PaddingError` that names the tokenizer and the filler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from phaselens.errors import PaddingError
from phaselens.integrations.lm_eval.tokens import tokenizer_name
from phaselens.tasks.text import encode, unit_id

# tried in order by filler="auto": punctuation after a space (one token in byte-level BPEs), then newlines
CANDIDATES = (" .", " ,", " -", " ;", "\n", ".", ",", " the")


@dataclass(frozen=True)
class Filler:
    """A checked filler: its ``text`` (one unit) and the one token ``id`` it encodes to, for ``tokenizer``."""

    text: str
    id: int
    tokenizer: str

    def pad(self, context: str, k: int) -> str:
        """``context`` behind ``k`` units of prefix padding."""
        return self.text * k + context


def make_filler(tok: Any, text: str) -> Filler:
    """``text`` as a filler unit of ``tok``: one token, repeated without merging; else a PaddingError."""
    if not isinstance(text, str) or not text:
        raise PaddingError(f"the filler must be a non-empty string, got {text!r}.")
    reason = None
    try:
        return Filler(text, int(unit_id(tok, text)), tokenizer_name(tok))
    except PaddingError as err:
        reason = str(err)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a word outside its vocabulary
        reason = f"the tokenizer cannot encode it ({str(err)[:60]}; a word-level vocabulary needs one of its words, e.g. 't100 ')"
    raise _refusal(text, tok, reason)


def _refusal(text: str, tok: Any, reason: str) -> PaddingError:
    err = PaddingError(f"the filler {text!r} cannot pad contexts token-exactly with the tokenizer "
                       f"{tokenizer_name(tok)}: {reason.rstrip('.')}. Choose another filler (filler='auto' tries "
                       f"{', '.join(map(repr, CANDIDATES))}).")
    err.reason = reason.rstrip(".")  # type: ignore[attr-defined]
    return err


def check_shift(tok: Any, filler: Filler, context: str, shifts: Iterable[int], *, base: Sequence[int] | None = None
                ) -> list[int]:
    """Check that ``k`` units in front of ``context`` shift its tokens by exactly ``k`` slots for each ``k`` in
    ``shifts``; return ``encode(context)`` (pass it as ``base`` when known). PaddingError names the tokenizer, the
    filler, the shift and where the ids first differ."""
    ids = list(encode(tok, context)) if base is None else list(base)
    for k in shifts:
        if k == 0:
            continue
        got = encode(tok, filler.pad(context, k))
        want = [filler.id] * k + ids
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            err = PaddingError(
                f"the filler {filler.text!r} does not pad this context token-exactly with the tokenizer "
                f"{filler.tokenizer}: {k} unit(s) in front of {context[:40]!r} encode to {got[max(0, at - 2):at + 3]} "
                f"at slot {at}, not {want[max(0, at - 2):at + 3]} (the unit merges with the context's first "
                "characters). Choose another filler, e.g. one ending in a space or a newline, or filler='auto'.")
            err.reason = f"merges with the start of {context[:20]!r}"  # type: ignore[attr-defined]
            raise err
    return ids


def choose_filler(tok: Any, filler: str, contexts: Sequence[str], shifts: Sequence[int]) -> Filler:
    """The filler: ``filler`` itself, checked, or for ``"auto"`` the first of :data:`CANDIDATES` that pads every
    one of ``contexts`` (a sample of the task's) exactly at every shift."""
    if filler != "auto":
        unit = make_filler(tok, filler)
        for context in contexts:
            check_shift(tok, unit, context, shifts)
        return unit
    reasons = []
    for text in CANDIDATES:
        try:
            unit = make_filler(tok, text)
            for context in contexts:
                check_shift(tok, unit, context, shifts)
            return unit
        except PaddingError as err:
            reasons.append(f"{text!r} ({getattr(err, 'reason', err)})")
    raise PaddingError(f"no filler pads this task's contexts token-exactly with the tokenizer {tokenizer_name(tok)}; "
                       f"tried {'; '.join(reasons)}. Pass filler='...' with a unit that is one token of this "
                       "tokenizer and stays apart from the text after it.")
