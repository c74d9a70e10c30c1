"""Token ids as every model kind takes them: checked once, here."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phaselens.errors import InputError


def check_tokens(tokens: Any, *, vocab: int, device: Any = None, n_ctx: int | None = None) -> Tensor:
    """``tokens`` as ``[batch, pos]`` int64 ids on ``device`` (a ``[pos]`` vector is one sequence).

    Raises :class:`InputError` for anything but integer ids with ``batch, pos >= 1``, ids outside
    ``0..vocab - 1``, or more than ``n_ctx`` positions (where given).
    """
    tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() == 2 and 0 in tokens.shape:
        raise InputError(f"tokens have shape {tuple(tokens.shape)}: a forward needs at least one sequence of at "
                         "least one token; drop empty batches before calling the model.")
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise InputError(f"tokens must be integer ids shaped [batch, pos] with batch, pos >= 1, got shape "
                         f"{tuple(tokens.shape)} and dtype {tokens.dtype}; use tokens.long().")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise InputError(f"token ids must lie in 0..{vocab - 1}, got {int(tokens.min())}..{int(tokens.max())}.")
    if n_ctx is not None and tokens.shape[1] > n_ctx:
        raise InputError(f"a sequence of {tokens.shape[1]} tokens exceeds the model's context n_ctx={n_ctx}; "
                         "shorten it.")
    return tokens.long() if device is None else tokens.long().to(device)
