"""Gate cycling as model surgery: a copy of a compressed transformer whose offset-specific gate parameters
are rolled (the model side of the ``cycle_gates`` capability; the analysis is
:func:`phaselens.analyses.cycling.gate_cycling_test`)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from phaselens.errors import NotApplicableError
from phaselens.models.compressed.compressor import Pooler


def _offset_params(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Offset-specific gate parameters as (name, parameter) with the phase axis at dim 1."""
    out = []
    if not hasattr(model, "named_modules"):  # an adapter: transformers' compressors are not phaselens Poolers
        return out
    for name, mod in model.named_modules():
        if not isinstance(mod, Pooler):
            continue
        if mod.gate is not None and mod.gate.weight.shape[1] == mod.stride and mod.stride > 1:
            out.append((f"{name}.gate.weight", mod.gate.weight))
        if mod.position_bias is not None:
            out.append((f"{name}.position_bias", mod.position_bias))
    return out


def roll_offset_gates(model: Any, delta: int) -> Any:
    """A copy of a phaselens model whose offset-specific gate parameters are rolled by ``delta``.

    The parameters of offset ``i`` move to offset ``(i + delta) mod S`` (``torch.roll(..., shifts=delta)``):
    per-offset gate weights ``[group, phase, d_model, channels]`` and the per-offset bias
    ``[group, phase, channels]`` roll along ``phase``. Payload maps, the entry's RoPE position (the first slot
    of its own block) and the block grid are unchanged.

    Overlapping windows (W = 2S, DeepSeek's ``overlap_split``): a token of phase p sits in two entries, at
    slot p of the Ca half (group 0) of one and slot p of the Cb half (group 1) of the other. The S rows of
    each half roll alike, within the half, so after the roll phase p carries in *both* its slots the
    parameters phase ``p - delta`` had; the Ca and Cb channel groups never exchange parameters. This is the
    only roll that is periodic in delta mod S (rolling the 2S slots as one sequence would move Ca rows into
    Cb slots, and delta = S would swap the halves instead of being the identity). What no parameter roll
    can move is structure tied to the block grid: which tokens share an entry, and so the Ca-to-Cb seam
    inside each window (see docs/zoo.md, "Gate cycling", for a model whose gates work across that seam).
    This is the model side of the ``cycle_gates`` capability (``CompressedTransformer.cycle_gates``).

    Raises:
        NotApplicableError: the model has no offset-specific gate parameters (uniform pooling, or shared gates
            without a position bias): cycling would be the identity.
    """
    if not _offset_params(model):
        raise NotApplicableError(
            "this model has no compressor with offset-specific gate parameters (uniform pooling, or shared "
            "gates without a per-offset bias), so there is nothing to roll; gate cycling does not apply."
        )
    out = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in _offset_params(out):
            # rolling by delta is rolling by delta mod S: any Python int (beyond int64 too) is exact
            p.copy_(torch.roll(p, shifts=int(delta) % p.shape[1], dims=1))
    if hasattr(out, "setup"):
        out.setup()
    return out
