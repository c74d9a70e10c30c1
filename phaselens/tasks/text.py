"""Token-id assembly for text tasks, and the checks that keep it faithful to the tokenizer.

Text tasks (``Needle``, ``PaddingProbe``) tokenise each *piece* (a template literal, a key, a value, one
padding unit) once and concatenate ids. That is fast and keeps the positions exact, but it is only right if
encoding the assembled text gives the same ids. :func:`verify_pieces` checks this on real assemblies, and
:func:`check_pad_site` checks the padding contract: adding one unit shifts every later id by exactly one and
leaves every other id unchanged (no merge at either seam). Both name the offending seam when they fail.

Works with ``tokenizers.Tokenizer`` and with transformers' fast tokenizers (``PreTrainedTokenizerFast`` /
``TokenizersBackend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phaselens.errors import PaddingError, TaskError


def encode(tok: Any, text: str, *, special: bool = False) -> list[int]:
    """Token ids of ``text``; ``special`` adds the tokenizer's BOS/template tokens."""
    try:
        import tokenizers

        if isinstance(tok, tokenizers.Tokenizer):
            return list(tok.encode(text, add_special_tokens=special).ids)
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        pass
    if hasattr(tok, "encode"):
        return list(tok.encode(text, add_special_tokens=special))
    raise TaskError(f"expected a tokenizers.Tokenizer or a transformers tokenizer, got {type(tok).__name__}.")


def special_prefix(tok: Any) -> tuple[int, ...]:
    """The ids the tokenizer puts before the text (BOS, ...); trailing special tokens (EOS) are not kept."""
    probe = "x"
    try:
        plain = encode(tok, probe)
    except Exception:  # a word-level vocabulary without "x" (the zoo's tN words): probe with a word it has
        probe = _vocabulary_word(tok)
        plain = encode(tok, probe)
    full = encode(tok, probe, special=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(full[:i])
    return ()


def _vocabulary_word(tok: Any) -> str:
    """The text of the first ordinary (non-special) token of the vocabulary that encodes back to itself."""
    special = set(getattr(tok, "all_special_ids", ()) or ())
    size = tok.get_vocab_size() if callable(getattr(tok, "get_vocab_size", None)) else len(tok)
    for i in range(min(size, 4096)):
        if i in special:
            continue
        text = tok.decode([i])
        try:
            if text.strip() and encode(tok, text) == [i]:
                return text
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for text it cannot encode
            continue
    raise TaskError("the tokenizer encodes none of its own first tokens back to themselves; pass prefix_ids=.")


def token_id(tok: Any, token: str) -> int | None:
    """The id of a vocabulary entry, or None."""
    if hasattr(tok, "token_to_id"):
        return tok.token_to_id(token)
    ids = tok.convert_tokens_to_ids(token) if hasattr(tok, "convert_tokens_to_ids") else None
    unk = getattr(tok, "unk_token_id", None)
    return None if ids is None or ids == unk else int(ids)


def default_pad_id(tok: Any, fallback: int) -> int:
    """The tokenizer's pad token, else its EOS, else a ``<pad>``-like entry, else ``fallback``.

    Any id works for right padding: no scored position attends to it.
    """
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tok, attr, None)
        if isinstance(value, int):
            return value
    for name in ("<pad>", "[PAD]", "<|pad|>", "<|endoftext|>", "</s>"):
        found = token_id(tok, name)
        if found is not None:
            return int(found)
    return int(fallback)


@dataclass(frozen=True)
class Piece:
    """A piece of text and the ids it contributes; ``unit`` marks a padding unit."""

    text: str
    ids: tuple[int, ...]
    unit: bool = False


def piece(tok: Any, text: str) -> Piece:
    return Piece(text, tuple(encode(tok, text)))


def _seam_message(pieces: Sequence[Piece], j: int) -> tuple[str, bool]:
    """Describe the seam between pieces j-1 and j; the flag says whether a padding unit takes part."""
    left, right = pieces[j - 1], pieces[j]
    before = repr("".join(p.text for p in pieces[max(0, j - 6) : j])[-24:])
    after = repr("".join(p.text for p in pieces[j : j + 6])[:24])
    if left.unit and right.unit:
        return f"inner seam (unit {left.text!r} | unit {right.text!r})", True
    if right.unit:
        return f"left seam (text {before} | unit {right.text!r})", True
    if left.unit:
        return f"right seam (unit {left.text!r} | text {after})", True
    return f"seam ({before} | {after})", False


def verify_pieces(tok: Any, pieces: Sequence[Piece], *, what: str) -> list[int]:
    """Check that encoding the concatenated text gives the concatenated ids; return those ids.

    Raises:
        PaddingError: the first mismatch sits at a seam with a padding unit (named, with the seam).
        TaskError: any other mismatch (a template piece or key that tokenises differently in context).
    """
    direct = [i for p in pieces for i in p.ids]
    text = "".join(p.text for p in pieces)
    got = encode(tok, text)
    if got == direct:
        return direct
    first = next((k for k, (a, b) in enumerate(zip(got, direct)) if a != b), min(len(got), len(direct)))
    # Piece j holds direct id `first`; a merge shows up at the last id before a seam or the first after it.
    bounds, pos = [], 0
    for p in pieces:
        bounds.append(pos)
        pos += len(p.ids)
    j = max(k for k, b in enumerate(bounds) if b <= first) if pieces else 0
    candidates = [s for s in (j, j + 1) if 0 < s < len(pieces)]
    described = [_seam_message(pieces, s) for s in candidates]
    unit_seams = [m for m, is_unit in described if is_unit]
    if unit_seams:
        unit = next(p.text for p in pieces if p.unit)
        raise PaddingError(
            f"{what}: padding unit {unit!r} does not stay one token; it merges at the {unit_seams[0]}. "
            "Choose a unit that the tokenizer keeps separate on both sides (e.g. with a leading space)."
        )
    where = described[0][0] if described else "the start of the text"
    raise TaskError(
        f"{what}: the text does not tokenise as its pieces do (first difference at id {first}, near {where}); "
        f"expected {direct[max(0, first - 2) : first + 3]}, got {got[max(0, first - 2) : first + 3]}. "
        "Move whitespace into the following slot or change the template so pieces tokenise independently."
    )


def unit_id(tok: Any, unit: str) -> int:
    """The single id of a padding unit; PaddingError if it is not one token or merges with itself."""
    ids = encode(tok, unit)
    if len(ids) != 1:
        raise PaddingError(f"padding unit {unit!r} is {len(ids)} tokens ({ids}); it must be exactly one.")
    triple = encode(tok, unit * 3)
    if triple != ids * 3:
        raise PaddingError(
            f"padding unit {unit!r} merges at the inner seam (unit | unit): {unit * 3!r} encodes as {triple}, "
            f"not {ids * 3}."
        )
    return ids[0]


def check_pad_site(tok: Any, pieces: Sequence[Piece], site: int, unit: Piece, *, what: str) -> None:
    """Encode the assembly with n and n + 1 units at ``site`` (a piece index) and compare.

    With n units the encoding must equal the assembled ids; with n + 1 it must equal the n-unit encoding with
    the unit's id inserted at the site, i.e. every later id shifts by exactly one and none changes.
    """
    verify_pieces(tok, pieces, what=what)
    k = sum(len(p.ids) for p in pieces[:site])
    more = [*pieces[:site], unit, *pieces[site:]]
    text_n = encode(tok, "".join(p.text for p in pieces))
    expected = [*text_n[:k], *unit.ids, *text_n[k:]]
    if encode(tok, "".join(p.text for p in more)) != expected:
        verify_pieces(tok, more, what=f"{what} (one more unit)")
        raise PaddingError(f"{what}: adding one unit {unit.text!r} does not shift later ids by exactly one.")


class UnitPadded:
    """A tokenizer task padded with one unit token (its compiled pieces ``_c`` hold ``unit``): what phase repair
    inserts to shift the items."""

    _c: Any

    @property
    def filler_ids(self) -> tuple[int, ...]:
        """The padding unit's id (what phase repair inserts to shift the items)."""
        return self._c.unit.ids
