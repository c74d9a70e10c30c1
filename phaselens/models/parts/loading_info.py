"""What transformers' ``from_pretrained(..., output_loading_info=True)`` reports, refused or warned about.

transformers loads a checkpoint that lacks a whole layer's tensors, prints its own report, and initialises the
missing weights at random: the model then computes, wrongly. Every phaselens loader that goes through
transformers (DeepSeek-V4, any causal LM) passes the report here. By default (``strict=True``) missing,
unexpected and mis-shaped tensors are a :class:`~phaselens.errors.CheckpointError` naming them; the user
can ask for transformers' behaviour explicitly with ``strict=False``, which loads with a
:class:`CheckpointMismatchWarning` naming them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from phaselens.errors import InputError
from phaselens.storage.resumable import tensor_mismatch


class CheckpointMismatchWarning(UserWarning):
    """A checkpoint loaded with ``strict=False`` although its tensors do not match the model."""


def check_strict(strict: Any) -> bool:
    """``strict=`` as given by a user, checked before anything is read."""
    if not isinstance(strict, bool):
        raise InputError(f"strict={strict!r} must be True (refuse a checkpoint whose tensors do not match the model) "
                         "or False (load it anyway, missing weights initialised at random, with a warning).")
    return strict


def check_loading_info(root: str | Path, info: dict[str, Any], *, strict: bool, fix: str) -> None:
    """Refuse (``strict``) or warn about the weights the checkpoint at ``root`` lacks, the tensors the model has
    no place for, and the mis-shaped ones, as transformers' loading ``info`` lists them.

    Raises:
        CheckpointError: with ``strict``, naming the tensors (a few of each and how many), ending with ``fix``
            and how to load anyway.
    """
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    wrong = [f"{k} {tuple(a)} where the model needs {tuple(b)}" for k, a, b in info.get("mismatched_keys") or ()]
    if not (missing or unexpected or wrong):
        return
    err = tensor_mismatch(missing, unexpected, wrong, where=str(root), fix=(
        f"{fix} To load it anyway (missing or mis-shaped weights initialised at random, as transformers does), pass "
        "strict=False."))
    if strict:
        raise err
    warnings.warn(CheckpointMismatchWarning(f"loaded with strict=False: {err}"), stacklevel=3)
