"""The members of the model contract (:class:`~phaselens.contract.protocol.PhaseModel`) that every kind's model
class computes alike, written once in :class:`KindModel`: ``dims``, ``identity()``, ``returns_query_logits``,
``analysis_metadata`` and the ``query_engine`` capability (one :class:`~.suffix_engine.SlotEngine` subclass per
kind, :meth:`KindModel._slot_engine`). A kind overrides what is its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phaselens.contract.cells import PASS_BYTES
from phaselens.contract.dims import ModelDims, ModelIdentity, config_dict
from phaselens.models.parts.suffix_engine import QueryEngine, SlotEngine, query_engine


class KindModel:
    """Mixin of a kind's model class, which provides ``cfg`` (TransformerLens-named sizes, ``local_window`` where
    it has one), ``config``, ``phase_specs``, ``analysis_spec``, ``_metadata`` and ``_check_tokens`` (token ids)."""

    default_task: Any = None
    chunk: int | None = None  # tokens per prefill piece (None: one call)

    @property
    def dims(self) -> ModelDims:
        """Sizes and phase geometry as analyses read them (the model contract)."""
        c = self.cfg
        dtype, device = self._weights_at()
        return ModelDims(n_layers=c.n_layers, n_heads=c.n_heads, n_key_value_heads=c.n_key_value_heads,
                         d_head=c.d_head, d_vocab=c.d_vocab, n_ctx=c.n_ctx, phase_specs=tuple(self.phase_specs),
                         analysis_spec=self.analysis_spec, local_window=getattr(c, "local_window", None),
                         prefill_chunk=self.chunk, dtype=dtype, device=device)

    def _weights_at(self) -> tuple[torch.dtype, torch.device]:
        """The weights' dtype and the device inputs go to (default: ``cfg``'s)."""
        c = self.cfg
        return c.dtype, c.device

    def identity(self) -> ModelIdentity:
        """The config and the module with every weight (fingerprints)."""
        return ModelIdentity(type(self).__qualname__, config_dict(self.config), self)

    @property
    def returns_query_logits(self) -> bool:
        """Whether analyses ask for the query rows' logits only (``logits="query"``); False: all logits fit."""
        return False

    @property
    def analysis_metadata(self) -> dict[str, Any]:
        """What a result must carry to be read correctly (a copy)."""
        return dict(self._metadata)

    # ---- the query_engine capability (phaselens.contract.protocol.CAPABILITIES) --------------------------
    def query_engine(self, tokens: Tensor, query_pos: Tensor, *, rows_per_pass: int = 4096,
                     batch_size: int | None = None, pass_bytes: int = PASS_BYTES) -> QueryEngine:
        """The ``query_engine`` capability: a :class:`~.suffix_engine.QueryEngine` over ``tokens`` ``[N, T]`` with
        query slots ``query_pos`` ``[N]``: the clean prefix once per query slot and piece of at most
        ``batch_size`` rows, then only the query rows per cell (the kind's :meth:`_slot_engine`)."""
        engine = self._slot_engine()
        return query_engine(self, engine, self._check_tokens(tokens), query_pos,
                            hooks_active=self._hooks_active(), rows_per_pass=rows_per_pass, batch_size=batch_size,
                            pass_bytes=pass_bytes)

    def _slot_engine(self) -> type[SlotEngine]:
        """The kind's per-slot engine class, imported on use (an engine imports its model's modules)."""
        raise NotImplementedError

    def _hooks_active(self) -> bool:
        """Whether hooks are active on the model: the engine then refuses to run (it could not honour them)."""
        return False
