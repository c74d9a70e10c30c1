"""A model's sizes and phase geometry as one value: :class:`ModelDims` (``model.dims``), and what
identifies a model for fingerprints: :class:`ModelIdentity` (``model.identity()``).

Every model kind builds these from its own configuration, so analyses never read a model-specific config
(``CompressedConfig``, the DeepSeek-V4 adapter's or V4.1's) and never guess with ``getattr``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import InputError


@dataclass(frozen=True)
class ModelDims:
    """Sizes and phase geometry of a model, as every analysis reads them.

    Attributes:
        n_layers, n_heads, n_key_value_heads, d_head, d_vocab: the usual sizes (``n_key_value_heads`` query
            heads share one key/value head in groups of ``n_heads // n_key_value_heads``).
        n_ctx: the longest input the model takes (slots).
        local_window: raw tokens a query of a compressed layer attends (``None``: no such layers).
        phase_specs: per layer, the :class:`PhaseSpec` of its compressor, ``None`` where it does not compress.
        analysis_spec: the geometry that defines phases for analysis (the smallest stride among the layers).
        copies: forwards per input (a phase ensemble runs ``copies`` shifted copies of every row).
        prefill_chunk: tokens per prefill call when the model prefills long inputs in chunks (``None``: one
            call); hooks then see only the query chunk.
        dtype, device: of the weights.
        black_box: the model only answers prompts (a served endpoint): no forward logits, no hooks and no
            layers phaselens can see (``n_layers`` 0). Analyses that need them refuse it with
            :class:`~phaselens.errors.NotApplicableError`; evaluation, phase repair and padding probes
            run on its answers (the ``answer_queries`` capability).
    """

    n_layers: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_vocab: int
    n_ctx: int
    phase_specs: tuple[PhaseSpec | None, ...]
    analysis_spec: PhaseSpec
    local_window: int | None = None
    copies: int = 1
    prefill_chunk: int | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    black_box: bool = False

    def __post_init__(self) -> None:
        if len(self.phase_specs) != self.n_layers:
            raise InputError(f"ModelDims: {len(self.phase_specs)} phase specs for {self.n_layers} layers.")
        if self.n_key_value_heads < 1 or self.n_heads % self.n_key_value_heads:
            raise InputError(f"ModelDims: {self.n_heads} heads cannot share {self.n_key_value_heads} KV heads.")

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_key_value_heads

    @property
    def compressed_layers(self) -> list[int]:
        """Layers whose compressor has a phase geometry."""
        return [i for i, s in enumerate(self.phase_specs) if s is not None]

    def with_copies(self, copies: int) -> ModelDims:
        """The same sizes for a wrapper that runs ``copies`` forwards per input."""
        from dataclasses import replace

        return replace(self, copies=int(copies))


@dataclass(frozen=True, eq=False)
class ModelIdentity:
    """What determines a model's numbers, for fingerprints (the journals of long runs).

    Attributes:
        kind: the model kind (a class name; a wrapper names itself and what it wraps).
        config: a JSON-able description of everything but the weights (config, numerics, wrapper settings).
        module: the ``torch.nn.Module`` holding every parameter and buffer (``None``: no weights).
    """

    kind: str
    config: Any
    module: torch.nn.Module | None = None


def config_dict(cfg: Any) -> Any:
    """A config as JSON-able data for :class:`ModelIdentity`: ``to_dict()`` of a phaselens config; a
    transformers config without its bookkeeping (keys starting with ``_``, ``transformers_version``), which
    does not change numbers."""
    if cfg is None:
        return None
    if hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
        if not dataclasses.is_dataclass(cfg):
            d = {k: v for k, v in d.items() if not str(k).startswith("_") and k != "transformers_version"}
        return d
    return repr(cfg)
