"""Per-layer phase geometry of a DeepSeek-V4 model, read from its config (never from constants).

``config.layer_types[l]`` names the attention of layer ``l`` and ``config.compress_rates`` maps a layer
type to its compression rate:

* ``compressed_sparse_attention`` (CSA) of rate ``r``: ``PhaseSpec(r, 2r)``, overlapping windows;
* ``heavily_compressed_attention`` (HCA) of rate ``r'``: ``PhaseSpec(r')``, disjoint windows;
* ``sliding_attention``: no compression, ``None``.

The origin is cache slot 0 for every layer: DeepSeek-V4 compresses from the first token, so BOS and any
chat template count as slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import UnsupportedModelError

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SLIDING = "sliding_attention"
LayerKind = Literal["csa", "hca", "sliding"]
_KINDS: dict[str, LayerKind] = {CSA: "csa", HCA: "hca", SLIDING: "sliding"}


@dataclass(frozen=True)
class LayerGeometry:
    """One layer: its transformers layer type, our short kind, and its :class:`PhaseSpec` (or ``None``)."""

    layer: int
    layer_type: str
    kind: LayerKind
    spec: PhaseSpec | None

    @property
    def compressed(self) -> bool:
        return self.spec is not None


def layer_geometry(config: Any) -> list[LayerGeometry]:
    """The geometry of every layer from ``config.layer_types`` and ``config.compress_rates``."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    n_layers = int(config.num_hidden_layers)
    if len(layer_types) != n_layers:
        raise UnsupportedModelError(
            f"config.layer_types has {len(layer_types)} entries for {n_layers} layers; pass layer_types "
            "explicitly (one of 'sliding_attention', 'compressed_sparse_attention', "
            "'heavily_compressed_attention' per layer) when building or loading the model."
        )
    rates = dict(getattr(config, "compress_rates", None) or {})
    out: list[LayerGeometry] = []
    for layer, layer_type in enumerate(layer_types):
        kind = _KINDS.get(layer_type)
        if kind is None:
            raise UnsupportedModelError(
                f"layer {layer} has layer type {layer_type!r}, which phaselens does not know; expected one "
                "of "
                f"{sorted(_KINDS)}. A newer DeepSeek variant needs its own adapter geometry."
            )
        spec = None
        if kind != "sliding":
            if layer_type not in rates:
                raise UnsupportedModelError(
                    f"config.compress_rates has no rate for {layer_type!r} (layer {layer}); pass "
                    f"compress_rates={{'{layer_type}': RATE, ...}} in the config."
                )
            rate = int(rates[layer_type])
            spec = PhaseSpec(rate, 2 * rate) if kind == "csa" else PhaseSpec(rate)
        out.append(LayerGeometry(layer, layer_type, kind, spec))
    return out


def resolve_analysis_stride(geometry: list[LayerGeometry], stride: int | None) -> int:
    """The stride that defines phases: ``stride`` if given (one of the model's or a multiple of one: the one rule,
    :func:`phaselens.contract.strides.check_stride`), else the smallest."""
    from phaselens.contract.strides import check_stride

    strides = sorted({g.spec.stride for g in geometry if g.spec is not None})  # the compressed layers' strides
    if not strides:
        raise UnsupportedModelError("the model has no compressed layers, so there is no stride to analyse.")
    if stride is None:
        return strides[0]
    return check_stride(stride, strides, option="analysis_stride", what="this DeepSeek-V4 model")
